"""The import boundaries that keep the layers apart: the engine never imports the lab, and inside
it each layer imports only the layers below it; the lab imports nothing of the engine but its
settings module; instruments never import the engine (they speak HTTP), only the store talks to
the database and it needs nothing of the lab above it, and analysis and reports never reach into
the runner. Checked on every module's import statements."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1] / "lab"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports; `from lab.store import models` counts as lab.store and
    lab.store.models (each name imported from a package may be a module of it)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted((LAB / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_engine_imports_nothing_of_the_lab(path: Path) -> None:
    outside = {m for m in imported_modules(path) if m.startswith("lab") and not m.startswith("lab.engine")}
    assert not outside, f"{path.relative_to(LAB)} imports {sorted(outside)}"


def _is_module(name: str) -> bool:
    path = LAB.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_lab_modules(path: Path) -> set[str]:
    """The lab modules `path` imports, `from package import module` naming the module itself."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" if _is_module(f"{node.module}.{alias.name}") else node.module
                         for alias in node.names)
    return {name for name in names if name == "lab" or name.startswith("lab.")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(LAB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The engine's layers, from the bottom up. A module is in the layer of its own entry, else of its
# package's (`lab.engine` itself is only the package's __init__). Core's config, sampling params,
# sequence and sampler are a layer of their own: kv and spec are written against them, and the
# rest of core drives kv and spec.
ENGINE_LAYERS = {
    "lab.engine.kernels": "kernels",
    "lab.engine.model_config": "leaves",
    "lab.engine.cache_dir": "leaves",
    "lab.engine.model": "model",
    "lab.engine.weights": "weights",
    "lab.engine.core.config": "core base",
    "lab.engine.core.sampling_params": "core base",
    "lab.engine.core.sequence": "core base",
    "lab.engine.core.sampler": "core base",
    "lab.engine.kv": "kv",
    "lab.engine.spec": "spec",
    "lab.engine.core": "core",
    "lab.engine.serve": "serve",
    "lab.engine.tools": "tools",
    "lab.engine.settings": "settings",
    "lab.engine": "entry points",
    "lab.engine.__main__": "entry points",
}

# The layers each layer may import besides itself. model and weights never import each other, nor
# do kv and spec.
_BELOW_KV = {"kernels", "leaves", "model", "weights", "core base"}
ENGINE_MAY_IMPORT: dict[str, set[str]] = {
    "kernels": set(),
    "leaves": set(),
    "model": {"kernels", "leaves"},
    "weights": {"leaves"},
    "core base": {"kernels", "leaves", "model", "weights"},
    "kv": _BELOW_KV,
    "spec": _BELOW_KV,
    "core": _BELOW_KV | {"kv", "spec"},
    "serve": _BELOW_KV | {"kv", "spec", "core"},
    "tools": _BELOW_KV | {"kv", "spec", "core", "serve"},
    "settings": {"leaves", "core base"},
    "entry points": _BELOW_KV | {"kv", "spec", "core", "serve", "tools", "settings"},
}


def engine_layer(module: str) -> str | None:
    """The layer of an engine module, or None when ENGINE_LAYERS names neither it nor its package."""
    parts = module.split(".")
    for n in range(len(parts), 2, -1):
        if (layer := ENGINE_LAYERS.get(".".join(parts[:n]))) is not None:
            return layer
    return ENGINE_LAYERS.get(module)


def test_the_engine_layers_form_no_cycle() -> None:
    """A boundary failure is not fixed by letting a layer import one that may import it."""
    try:
        list(graphlib.TopologicalSorter(ENGINE_MAY_IMPORT).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"engine layers that may import each other: {exc.args[1]}")


@pytest.mark.parametrize("path", sorted((LAB / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_each_engine_module_imports_only_the_layers_below_its_own(path: Path) -> None:
    module = _module_name(path)
    layer = engine_layer(module)
    assert layer is not None, f"{module} is in no layer: add it (or its package) to ENGINE_LAYERS"
    above = {m: engine_layer(m) for m in imported_lab_modules(path)
             if engine_layer(m) not in ENGINE_MAY_IMPORT[layer] | {layer}}
    assert not above, (f"{path.relative_to(LAB)} ({layer}) imports {above}; {layer} may import only "
                       f"{sorted(ENGINE_MAY_IMPORT[layer])}")


# What the rest of lab may import of the engine: its settings, and the CLI's `lab engine` runs the
# engine's own entry point in-process.
LAB_MAY_IMPORT_OF_THE_ENGINE = {"lab.engine.settings"}
CLI_MAY_IMPORT_OF_THE_ENGINE = LAB_MAY_IMPORT_OF_THE_ENGINE | {"lab.engine.__main__"}


@pytest.mark.parametrize("path", [p for p in sorted(LAB.rglob("*.py")) if not p.is_relative_to(LAB / "engine")],
                         ids=lambda p: str(p.relative_to(LAB)))
def test_the_lab_imports_only_the_engine_s_settings(path: Path) -> None:
    allowed = CLI_MAY_IMPORT_OF_THE_ENGINE if path == LAB / "cli.py" else LAB_MAY_IMPORT_OF_THE_ENGINE
    engine = {m for m in imported_lab_modules(path) if m == "lab.engine" or m.startswith("lab.engine.")}
    assert engine <= allowed, (f"{path.relative_to(LAB)} imports {sorted(engine - allowed)}: the lab imports the "
                               f"engine through lab.engine.settings only")


@pytest.mark.parametrize("path", sorted((LAB / "instruments").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_instruments_do_not_import_the_engine(path: Path) -> None:
    engine = {m for m in imported_modules(path) if m.startswith("lab.engine")}
    assert not engine, f"{path.relative_to(LAB)} imports {sorted(engine)}"


def _lab_modules() -> list[Path]:
    return sorted(LAB.rglob("*.py"))


@pytest.mark.parametrize("path", _lab_modules(), ids=lambda p: str(p.relative_to(LAB)))
def test_only_the_store_talks_to_the_database(path: Path) -> None:
    if path.is_relative_to(LAB / "store"):
        return
    sql = {m for m in imported_modules(path) if m.split(".")[0] == "sqlalchemy"}
    assert not sql, f"{path.relative_to(LAB)} imports {sorted(sql)}: queries belong in lab/store"


@pytest.mark.parametrize("path", _lab_modules(), ids=lambda p: str(p.relative_to(LAB)))
def test_only_the_store_sees_its_tables(path: Path) -> None:
    """Readers hand out records (`lab.store.rows`), never ORM rows: a row outside the session that
    loaded it is a detached object whose lazy attributes fail far from the query."""
    if path.is_relative_to(LAB / "store"):
        return
    assert "lab.store.models" not in imported_modules(path), \
        f"{path.relative_to(LAB)} imports lab.store.models: read records through lab.store.reader"


@pytest.mark.parametrize("path", sorted([*(LAB / "analysis").rglob("*.py"), *(LAB / "report").rglob("*.py")]),
                         ids=lambda p: str(p.relative_to(LAB)))
def test_analysis_and_reports_never_write_to_the_store(path: Path) -> None:
    """`lab report`, `lab compare` and the analysis they share only read: only the runner writes."""
    assert "lab.store.writer" not in imported_modules(path), f"{path.relative_to(LAB)} imports lab.store.writer"


@pytest.mark.parametrize("path", sorted((LAB / "store").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_the_store_imports_nothing_of_the_lab_above_it(path: Path) -> None:
    outside = {m for m in imported_modules(path) if m.startswith("lab") and not m.startswith("lab.store")}
    assert not outside, f"{path.relative_to(LAB)} imports {sorted(outside)}"


@pytest.mark.parametrize("path", sorted([*(LAB / "analysis").rglob("*.py"), *(LAB / "report").rglob("*.py")]),
                         ids=lambda p: str(p.relative_to(LAB)))
def test_analysis_and_reports_do_not_import_the_runner(path: Path) -> None:
    runner = {m for m in imported_modules(path) if m == "lab.runner" or m.startswith("lab.runner.")}
    assert not runner, f"{path.relative_to(LAB)} imports {sorted(runner)}"


@pytest.mark.parametrize("path", sorted((LAB / "instruments").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_instruments_import_neither_the_runner_nor_the_analysis_above_them(path: Path) -> None:
    """Instruments measure; the runner drives them and the analysis judges what they stored."""
    above = {m for m in imported_modules(path) if m.split(".")[:2] in (["lab", "runner"], ["lab", "analysis"])}
    assert not above, f"{path.relative_to(LAB)} imports {sorted(above)}"


def test_lab_ls_reads_the_store_without_loading_the_runner_or_scipy(tmp_path: Path) -> None:
    """Listing runs only reads: it must not pay for the runner, the analysis and scipy (a second of
    imports on a small host) on every call."""
    from lab.store.db import open_store

    open_store(str(tmp_path / "lab.db")).close()
    code = ("import sys; from lab.cli import main; code = main(['ls', '--db', sys.argv[1]]); "
            "loaded = [m for m in ('scipy', 'lab.runner.run', 'lab.analysis.verdicts') if m in sys.modules]; "
            "assert code == 0 and not loaded, (code, loaded)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lab.db")], capture_output=True, text=True,
                          cwd=LAB.parent, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_api_imports_without_the_server_and_its_config_without_torch() -> None:
    code = ("import sys; import lab.engine; assert 'torch' not in sys.modules, 'torch'; "
            "from lab.engine import LLM, EngineConfig, SamplingParams; "
            "assert LLM.__name__ == 'LLM' and EngineConfig().max_num_seqs > 0 and SamplingParams().max_tokens; "
            "loaded = [m for m in ('fastapi', 'uvicorn', 'lab.engine.serve.server') if m in sys.modules]; "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_settings_the_lab_imports_load_without_torch() -> None:
    code = ("import sys; from lab.engine import settings; assert 'torch' not in sys.modules, 'torch'; "
            "assert settings.from_sources({'max-num-seqs': 7}, {}).max_num_seqs == 7; "
            "assert settings.PRESETS['smollm2-135m'].max_position_embeddings > 0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_reference_attention_path_and_the_kernels_shared_constants_load_without_triton() -> None:
    code = ("import sys; import lab.engine.model.attention, lab.engine.kernels.cache_dtypes; "
            "assert 'triton' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _tests_engine_kind(path: Path) -> list[str]:
    """`isinstance(x, BundledEngine)` / `CommandEngine`, or `.kind == "bundled"`: places that branch on
    which engine a ladder boots instead of asking its kind object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
            found += sorted(names & {"BundledEngine", "CommandEngine"})
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
            found += [c.value for c in node.comparators if isinstance(c, ast.Constant) and c.value in ("bundled", "command")]
    return found


@pytest.mark.parametrize("path", [p for p in _lab_modules() if not p.is_relative_to(LAB / "engine")
                                  and p != LAB / "ladder" / "engines.py"], ids=lambda p: str(p.relative_to(LAB)))
def test_the_lab_asks_the_engine_kind_instead_of_testing_which_engine_it_is(path: Path) -> None:
    """Launching, validating flags, computing a config, checking what booted and running offline
    differ between the bundled engine and a command engine; `lab/ladder/engines.py` holds each
    difference once, as a method of the kind."""
    found = _tests_engine_kind(path)
    assert not found, f"{path.relative_to(LAB)} tests the engine's kind ({found}): ask lab.ladder.engines.kind_of"
