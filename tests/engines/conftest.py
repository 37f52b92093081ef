"""Third-party engines, run by `make test-engines` only (each needs its own venv, and together
they take longer than the main suite's budget allows)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def llamacpp_python() -> Path:
    """The interpreter of llama-cpp-python's own venv, which `make engine-llamacpp` builds."""
    python = REPO / ".venv-engines" / "llamacpp" / "bin" / "python"
    assert python.exists(), f"no {python}: run `make engine-llamacpp` (or `make test-engines`)"
    return python
