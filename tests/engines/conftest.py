"""Third-party engines, run by `make test-engines` only (each needs its own venv, and together
they take longer than the main suite's budget allows).

Every process these tests start goes whatever ends them: `lab` is started through parent_death
(the kernel sends it SIGTERM if pytest dies, SIGKILL included) and stops its engine on SIGTERM;
an interrupted or timed-out test terminates its `lab` (tests/instruments/ladder_run.py); and the
session ends by stopping any child process still running."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import psutil
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


@pytest.fixture(scope="session", autouse=True)
def _no_process_left() -> Iterator[None]:
    """At the session's end, SIGTERM to every process this pytest started that still runs, SIGKILL
    to those still there 10 s later."""
    yield
    left = psutil.Process().children(recursive=True)
    for child in left:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=10)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
