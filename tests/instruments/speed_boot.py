"""The speed instruments' test bench: one real engine server and a real SQLite store (the `bench`
fixture of tests/instruments/conftest.py), with each measurement run step by step and written
through the store's writer the way `lab run` does it (lab/runner/slot.py), so tests read back exactly
what a run would have stored."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from sqlalchemy import select

from lab.instruments.base import BootContext, Instrument
from lab.ladder.render import plan
from lab.ladder.validate import parse_ladder
from lab.runner.mem_sampler import MemSampler
from lab.store import models as m
from lab.store import writer
from lab.store.db import Store
from lab.store.stored_rows import StoredRows
from tests.engine.server_process import ServerProcess, free_port

MODEL = "smollm2-135m"
LADDER = """\
name: speed
engine: {kind: bundled}
windows:
  - name: W1
    arms:
      - {name: A1, flags: {seed: 1}}
"""
# 4K context: room for the 2K needle, small enough to refuse a 5K prompt.
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "4096",
                "--kv-cache-memory-bytes", str(256 * 2**20))
_runs = count(1)


@dataclass
class Stored:
    """One measurement as the store holds it."""

    steps: list[m.Step]
    cells: list[m.Cell]
    requests: dict[int, m.Request]  # by id

    def cell(self, metric: str, repeat: int = 0, **params: Any) -> m.Cell:
        found = [c for c in self.cells if c.metric == metric and c.repeat == repeat and c.params == params]
        assert len(found) == 1, f"{metric} {params} repeat {repeat}: {len(found)} cells"
        return found[0]

    def of(self, metric: str) -> list[m.Cell]:
        return [c for c in self.cells if c.metric == metric]

    def requests_of(self, cell: m.Cell) -> list[m.Request]:
        return [self.requests[i] for i in cell.request_ids]


@dataclass
class SpeedBench:
    store: Store
    server: ServerProcess
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tests.speed"))

    def measure(self, instrument: Instrument, params: dict[str, Any], *, salt: str,
                base_url: str | None = None, model: str = MODEL,
                capabilities: dict[str, Any] | None = None) -> Stored:
        """Every planned step of `instrument` on a boot of its own, stored as `lab run` stores it:
        an exception from a step is that step's error."""
        run_id, slot_id, boot_id = self._boot()
        base_url = base_url or self.server.url
        ctx = BootContext(base_url=base_url, api_base=f"{base_url}/v1", model=model, api_key=None, run_id=run_id,
                          run_name=f"speed-{run_id}", slot_id=slot_id, boot_id=boot_id, arm="A1", window="W1",
                          role="arm", position="arm", salt=salt, engine_kind="bundled",
                          params=instrument.Params(**params), stored=StoredRows(self.store), control_boot_ids=[],
                          mem=MemSampler(), log=self.log, capabilities=capabilities)
        for step in instrument.plan(ctx.params):
            started = writer.now()
            try:
                result, error = asyncio.run(instrument.run_step(ctx, step)), None
            except Exception as exc:  # noqa: BLE001 - stored as the step's error, as lab run does
                result, error = None, f"{type(exc).__name__}: {exc}"
            writer.write_step(self.store, slot_id=slot_id, boot_id=boot_id, instrument=instrument.name, step=step,
                              result=result, error=error, started_at=started)
        with self.store.session() as s:
            steps = s.scalars(select(m.Step).where(m.Step.boot_id == boot_id).order_by(m.Step.id)).all()
            cells = s.scalars(select(m.Cell).where(m.Cell.boot_id == boot_id).order_by(m.Cell.id)).all()
            requests = s.scalars(select(m.Request).where(m.Request.boot_id == boot_id)).all()
        return Stored(list(steps), list(cells), {r.id: r for r in requests})

    def _boot(self) -> tuple[int, int, int]:
        name = f"speed-{next(_runs)}"
        run_id = writer.create_run(self.store, name=name, ladder_name="speed", ladder_path="speed.yaml",
                                   ladder_text=LADDER, sha256="0" * 64, engine_kind="bundled", logs_dir="/tmp",
                                   plan=plan(parse_ladder(LADDER, "speed.yaml")))
        with self.store.session() as s:
            slot_id = s.scalar(select(m.Slot.id).where(m.Slot.run_id == run_id, m.Slot.role == "arm"))
        boot_id, _ = writer.start_boot(self.store, run_id=run_id, slot_id=slot_id)
        return run_id, slot_id, boot_id


def dead_url() -> str:
    """An address where no engine listens: a boot whose engine has gone away."""
    return f"http://127.0.0.1:{free_port()}"
