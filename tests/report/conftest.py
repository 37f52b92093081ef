"""Stores for compare/report/export tests: runs built cell by cell, and one real run of the quickstart
with its instruments shrunk.

`build_run` writes through the same writer `lab run` uses, so a constructed run is exactly what a
real one would store; only the figures are chosen by the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from sqlalchemy import select

from lab.ladder.ladder import Ladder
from lab.ladder.render import plan
from lab.ladder.validate import load_ladder, parse_ladder
from lab.store import models as m
from lab.store import writer
from lab.store.db import Store, open_store
from lab.store.records import Cell, QevalItem, Step, StepResult

REPO = Path(__file__).resolve().parents[2]

# Two arms in one window; kv_pool_tokens (higher is better) is the key metric, the host memory
# floor a gate.
LADDER = """\
name: built
engine: {kind: bundled, model: smollm2-135m, flags: {device: cpu}}
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
      - {name: A2, flags: {max-num-seqs: 8}}
instruments:
  memory:
keep:
  threshold_pct: 2
  metrics: [memory.kv_pool_tokens]
  gates:
    - {metric: memory.host_mem_available_floor_gib, min: 1}
"""


@dataclass
class Boot:
    """What one slot stored."""

    values: dict[str, float | list[float]] = field(default_factory=dict)  # "instrument.metric" -> value or repeats
    cells: dict[str, list[Cell]] = field(default_factory=dict)  # instrument -> further cells (with params)
    items: dict[str, bool] = field(default_factory=dict)  # qeval task -> passed
    status: str = "done"
    cold: bool = False
    reason: str | None = None


def build_run(store: Store, boots: dict[str, Boot], ladder: str = LADDER, name: str = "built") -> int:
    """A run of `ladder` whose slots (named "C0ctl/open", "A1", "C0ctl/close"…) stored `boots`.

    A slot not named in `boots` stays pending, as in a run still in progress.
    """
    text = textwrap.dedent(ladder)
    parsed = parse_ladder(text, "t.yaml")
    run_id = writer.create_run(store, name=name, ladder_name=parsed.name, ladder_path="t.yaml", ladder_text=text,
                               sha256="0" * 64, engine_kind="bundled", logs_dir="/tmp", plan=plan(parsed))
    with store.session() as s:
        slots = s.scalars(select(m.Slot).where(m.Slot.run_id == run_id).order_by(m.Slot.idx)).all()
        labels = {(slot.arm.name if slot.role == "arm" else f"{slot.arm.name}/{slot.position}"): slot.id
                  for slot in slots}
    for label, boot in boots.items():
        slot_id = labels[label]
        boot_id, _ = writer.start_boot(store, run_id=run_id, slot_id=slot_id, fingerprint={"host": "test"})
        writer.update_boot(store, boot_id, status=boot.status, cold=boot.cold, reason=boot.reason,
                           ready_at=writer.now(), stopped_at=writer.now())
        steps: dict[str, list[Cell]] = {name: list(cells) for name, cells in boot.cells.items()}
        for metric, value in boot.values.items():
            instrument, _, name = metric.partition(".")
            repeats = value if isinstance(value, list) else [value]
            steps.setdefault(instrument, []).extend(Cell(name, v, _unit(name), repeat=i, requests=[])
                                                    for i, v in enumerate(repeats))
        if boot.items:
            steps.setdefault("qeval", [])
        for instrument, cells in steps.items():
            items = [QevalItem(task, passed) for task, passed in boot.items.items()] if instrument == "qeval" else []
            writer.write_step(store, slot_id=slot_id, boot_id=boot_id, instrument=instrument, step=Step("all"),
                              result=StepResult(cells=cells, items=items), error=None, started_at=writer.now())
        writer.set_slot_status(store, slot_id, "done" if boot.status == "done" else "failed")
    writer.set_run_status(store, run_id, "done")
    return run_id


def _unit(metric: str) -> str:
    return "tokens" if metric.endswith("tokens") else "GiB"


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(str(tmp_path / "lab.db"))
    yield s
    s.close()


def lab_cli(args: list[str], cwd: Path, columns: int = 250) -> subprocess.CompletedProcess[str]:
    """`lab ARGS` as its own process, as a person runs it, output piped at `columns` wide."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


# What the report, compare and notebook tests read from a real run is its shape (every boot of a
# window, every instrument's cells, the KEEP rule's rows and verdicts), not the size of each
# measurement: `make demo` runs the full-size quickstart. The key metrics' `where` (prefill length
# 1024, decode level 4) stay among the parameters so the ladder's own rule still applies.
SMALL_INSTRUMENTS: dict[str, dict[str, object]] = {
    "qeval": {"per_category": 1, "max_tokens_scale": 0.125},  # one task per category, code run included
    "agreement": {"prompts": 2, "max_tokens": 4},
    "prefill": {"lengths": [128, 1024], "reps": 1},
    "needle": {"lengths": [256], "depths": [0.5]},
    "decode": {"levels": [4, 8], "max_tokens": 4},  # eight streams per level: one or two batches each
    # 512 tokens take about a second to prefill on two cores, ten times the delay: the short chat
    # still lands behind it on a much faster machine.
    "mixed": {"long_tokens": 512, "delay_s": 0.1, "short_max_tokens": 4},
}


def small_quickstart(directory: Path) -> Path:
    """ladders/quickstart.yaml as written (engine, window, arms, KEEP rule, hygiene, warm-up boot),
    each instrument it lists with the parameters of SMALL_INSTRUMENTS."""
    ladder = yaml.safe_load((REPO / "ladders" / "quickstart.yaml").read_text())
    ladder["name"] = f"{ladder['name']}-small"
    ladder["instruments"] = {name: SMALL_INSTRUMENTS.get(name, params)
                             for name, params in ladder["instruments"].items()}
    path = directory / "quickstart-small.yaml"
    path.write_text(yaml.safe_dump(ladder, sort_keys=False))
    return path


@dataclass(frozen=True)
class Quickstart:
    directory: Path
    db: Path
    run: str
    ladder_path: Path

    @property
    def ladder(self) -> Ladder:
        return load_ladder(self.ladder_path)[0]


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Quickstart:
    """`lab run` of the small quickstart once per test session, on the bundled engine and SmolLM2.
    Test workers share it: the first to need it runs it under a lock, the others wait and read it
    (the xdist recipe), since the files that use it often land on different workers."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist the session's folder is above each worker's; without it, the run's own folder.
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    directory = shared / "quickstart"
    with FileLock(shared / "quickstart.lock"):
        if not (directory / "ran").exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a worker's failed run left
            directory.mkdir()
            ladder = small_quickstart(directory)
            done = lab_cli(["run", str(ladder), "--name", "qs", "--db", "lab.db", "--runs-dir", "runs"], directory)
            assert done.returncode == 0, done.stdout + done.stderr
            (directory / "ran").write_text(str(ladder))
    return Quickstart(directory, directory / "lab.db", "qs", Path((directory / "ran").read_text()))
