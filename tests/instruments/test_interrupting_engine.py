"""An engine that serves one request at a time and cuts the stream in progress when another arrives
(llama-cpp-python's server by default): the capability probe finds it, and every figure that rests on
overlapping requests is stored invalid with the reason and the setting that fixes it, instead of
streams "ended early" counted as valid. The scripted engine plays that server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from lab.cli import main as lab_main
from lab.instruments.capabilities import Endpoint, overlap
from lab.report.listing import print_run
from lab.store import models as m
from lab.runner.boot import free_port
from lab.store.db import open_store

pytestmark = pytest.mark.slow
SCRIPTED = Path(__file__).resolve().parents[2] / "benchmarks" / "scripted_engine.py"
LADDER = f"""\
name: interrupting
engine:
  kind: command
  command: [{sys.executable}, {SCRIPTED}, --port, "{{port}}", --model, "{{model}}", --step-ms, "5"]
  model: scripted
  bool_style: switch
  ready_timeout_s: 60
  stop_grace_s: 5
windows:
  - name: W1
    control: C0ctl
    arms:
      - {{name: A1interrupts, flags: {{interrupt-requests: true}}}}
instruments:
  decode: {{levels: [1, 2], max_tokens: 16}}
keep:
  metrics:
    - {{metric: decode.stream_tok_s, where: {{level: 1}}}}
hygiene: {{warmup_boot: false, min_mem_available_gib: 0.1}}
"""


def test_an_engine_that_interrupts_overlapping_requests_has_those_cells_invalid_with_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "l.yaml").write_text(LADDER)
    assert lab_main(["run", "l.yaml", "--db", "lab.db", "--name", "i"]) == 0
    store = open_store(str(tmp_path / "lab.db"), read_only=True)
    try:
        with store.session() as s:
            boots = {(arm, slot.position): boot for boot, slot, arm in s.execute(
                select(m.Boot, m.Slot, m.Arm.name).join(m.Slot, m.Boot.slot_id == m.Slot.id)
                .join(m.Arm, m.Slot.arm_id == m.Arm.id))}
            cells = {(arm, slot.position, c.metric, c.params["level"]): c for c, slot, arm in s.execute(
                select(m.Cell, m.Slot, m.Arm.name).join(m.Slot, m.Cell.slot_id == m.Slot.id)
                .join(m.Arm, m.Slot.arm_id == m.Arm.id).where(m.Cell.metric == "stream_tok_s"))}
        assert boots[("C0ctl", "open")].capabilities["overlap"] == {"found": "kept"}
        cut = boots[("A1interrupts", "arm")].capabilities["overlap"]
        assert cut["found"] == "interrupted" and "cut the first stream short" in cut["why"], cut
        assert cells[("C0ctl", "open", "stream_tok_s", 2)].valid
        assert cells[("A1interrupts", "arm", "stream_tok_s", 1)].valid  # one stream at a time is fine
        level2 = cells[("A1interrupts", "arm", "stream_tok_s", 2)]
        assert not level2.valid and level2.value is None
        assert level2.note.startswith("the engine interrupts a request in progress when another arrives: ")
        assert level2.note.endswith("llama-cpp-python's server: start it with --interrupt_requests false)")
        capsys.readouterr()
        print_run(__import__("rich.console", fromlist=["Console"]).Console(width=250), store, "i")
        assert "overlapping requests interrupted" in capsys.readouterr().out
    finally:
        store.close()


@pytest.mark.parametrize("interrupts, found", [(False, "kept"), (True, "interrupted")])
def test_a_stream_that_ends_at_eos_is_not_taken_for_an_interrupted_one(interrupts: bool, found: str) -> None:
    # llama.cpp's server ignores ignore_eos: the probe's stream ends at EOS, overlapped or not.
    port = free_port()
    argv = [sys.executable, str(SCRIPTED), "--port", str(port), "--step-ms", "5", "--eos-after", "30"]
    engine = subprocess.Popen(argv + (["--interrupt-requests"] if interrupts else []),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not _answers(f"{base}/v1/models"):
            assert engine.poll() is None and time.monotonic() < deadline, "the scripted engine did not start"
            time.sleep(0.1)
        got = asyncio.run(overlap(Endpoint(base, f"{base}/v1", "scripted", None), "salt"))
    finally:
        engine.terminate()
        engine.wait(10)
    assert got["found"] == found, got
    if interrupts:
        assert "alone it gave 30, finish_reason 'stop'" in got["why"], got


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
