"""The engine the soak and resident-needle tests share: SmolLM2 on the CPU with a KV pool of 2,560
tokens, room for two soak sessions of about 800 tokens but not for two resident sessions of
1,000 and a needle of 1,000 at once. A package of its own, so it never runs beside the other
instrument tests' engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.store.db import open_store
from tests.engine.server_process import engine_server
from tests.instruments.speed_boot import SpeedBench

POOL_TOKENS = 2560
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
                "--num-kv-blocks", str(POOL_TOKENS // 16), "--block-size", "16")


@pytest.fixture(scope="package")
def sessions_bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpeedBench]:
    tmp = tmp_path_factory.mktemp("sessions")
    store = open_store(str(tmp / "lab.db"))
    with engine_server(tmp, *ENGINE_FLAGS) as server:
        yield SpeedBench(store, server)
    store.close()
