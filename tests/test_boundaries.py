"""The design's two import boundaries: the engine never imports the lab, and instruments never
import the engine (they speak HTTP). Checked on every module's import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1] / "lab"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((LAB / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_engine_imports_nothing_of_the_lab(path: Path) -> None:
    outside = {m for m in imported_modules(path) if m.startswith("lab") and not m.startswith("lab.engine")}
    assert not outside, f"{path.relative_to(LAB)} imports {sorted(outside)}"


@pytest.mark.parametrize("path", sorted((LAB / "instruments").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_instruments_do_not_import_the_engine(path: Path) -> None:
    engine = {m for m in imported_modules(path) if m.startswith("lab.engine")}
    assert not engine, f"{path.relative_to(LAB)} imports {sorted(engine)}"
