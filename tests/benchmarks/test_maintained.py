"""What keeps a script in `benchmarks/`: a one-line summary opening its docstring, `--help` through
argparse, a line in benchmarks/README.md, and a test in tests/benchmarks/ that runs it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import BENCHMARKS, ROOT

SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "kernels").glob("*.py")])
LADDERS = sorted((BENCHMARKS / "ladders").glob("*.yaml"))
README = (BENCHMARKS / "README.md").read_text()


def relative(path: Path) -> str:
    return path.relative_to(BENCHMARKS).as_posix()


def summary(path: Path) -> str:
    return (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]


@pytest.mark.parametrize("path", SCRIPTS, ids=relative)
def test_a_script_opens_with_a_one_line_summary(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    first, _, rest = docstring.partition("\n")
    assert first.endswith(".") and len(first) > 20, f"{relative(path)}: first line {first!r}"
    assert rest == "" or rest.startswith("\n"), f"{relative(path)}: a blank line must follow the summary"


@pytest.mark.parametrize("path", [*SCRIPTS, *LADDERS], ids=relative)
def test_a_script_or_ladder_has_its_line_in_the_readme(path: Path) -> None:
    assert f"`{relative(path)}`" in README


@pytest.mark.parametrize("path", SCRIPTS, ids=relative)
def test_a_script_is_run_by_a_test(path: Path) -> None:
    tests = [p for p in Path(__file__).parent.glob("test_*.py") if p.name != Path(__file__).name]
    assert any(f'"{relative(path)}"' in p.read_text() for p in tests), f"no test runs {relative(path)}"


# Each script's --help in one child process (torch is imported once): run as `python SCRIPT --help`
# would, its folder first on sys.path.
HELP = """
import contextlib, io, json, runpy, sys
found = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as exit:
        code = exit.code
    except Exception as error:  # a broken script is reported with the others
        code = repr(error)
    finally:
        sys.path.pop(0)
    found[path] = [code, out.getvalue()]
print(json.dumps(found))
"""


def test_every_script_answers_help_with_its_summary() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HELP, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    for path in SCRIPTS:
        code, text = found[str(path)]
        assert code == 0 and text.startswith("usage: "), f"{relative(path)}: exit {code}, {text[:200]!r}"
        assert " ".join(summary(path).split()) in " ".join(text.split()), f"{relative(path)}: --help lacks its summary"
