"""The engine the instrument tests share when they measure a live server without `lab run`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.store.db import open_store
from tests.engine.server_process import engine_server
from tests.instruments.speed_boot import ENGINE_FLAGS, SpeedBench


@pytest.fixture(scope="package")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpeedBench]:
    """One engine for the decode, mixed, needle, prefill and agreement tests: every measurement is
    a boot of its own in the store with its own salt, so none sees another's prompts or cached
    blocks."""
    tmp = tmp_path_factory.mktemp("speed")
    store = open_store(str(tmp / "lab.db"))
    with engine_server(tmp, *ENGINE_FLAGS) as server:
        yield SpeedBench(store, server)
    store.close()
