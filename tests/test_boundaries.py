"""The import boundaries that keep the layers apart: the engine never imports the lab, instruments
never import the engine (they speak HTTP), and only the store talks to the database, needing
nothing of the lab above it. Checked on every module's import statements."""

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


def _lab_modules() -> list[Path]:
    return sorted(LAB.rglob("*.py"))


@pytest.mark.parametrize("path", _lab_modules(), ids=lambda p: str(p.relative_to(LAB)))
def test_only_the_store_talks_to_the_database(path: Path) -> None:
    if path.is_relative_to(LAB / "store"):
        return
    sql = {m for m in imported_modules(path) if m.split(".")[0] == "sqlalchemy"}
    assert not sql, f"{path.relative_to(LAB)} imports {sorted(sql)}: queries belong in lab/store"


@pytest.mark.parametrize("path", sorted((LAB / "store").rglob("*.py")), ids=lambda p: str(p.relative_to(LAB)))
def test_the_store_imports_nothing_of_the_lab_above_it(path: Path) -> None:
    outside = {m for m in imported_modules(path) if m.startswith("lab") and not m.startswith("lab.store")}
    assert not outside, f"{path.relative_to(LAB)} imports {sorted(outside)}"
