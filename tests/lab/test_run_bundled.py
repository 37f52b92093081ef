"""`lab run` against the real bundled engine on SmolLM2 (a few seconds per boot on two cores)."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from lab.engine import settings as engine_settings
from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import lab_process
from tests.lab.test_resume import alive, cell_keys, finish, wait_for_steps

pytestmark = pytest.mark.slow

BASE_FLAGS = {"device": "cpu", "max-model-len": 1024, "kv-cache-memory-bytes": 67108864}
LADDER = """\
    name: tiny
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, max-model-len: 1024, kv-cache-memory-bytes: 67108864}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1seqs4, flags: {max-num-seqs: 4}}
    instruments:
      ping: {steps: 3, delay_s: 0.3}
      memory:
    keep:
      metrics: [memory.peak_memory_gib]
    """


def expected_hash(**flags: object) -> str:
    return engine_settings.from_sources({**BASE_FLAGS, **flags, "model": "smollm2-135m"}, {}).hash


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the tiny ladder, as a process, with the test-only ping instrument."""
    cwd = tmp_path_factory.mktemp("whole")
    (cwd / "tiny.yaml").write_text(textwrap.dedent(LADDER))
    code, out = finish(lab_process(["run", "tiny.yaml", "--name", "whole"], cwd, with_ping=True), timeout=300)
    assert code == 0, out
    return cwd


def test_tiny_ladder_writes_run_arms_boots_steps_cells_and_receipts(whole: Path) -> None:
    store = open_store(str(whole / "lab.db"))
    with store.session() as s:
        run = s.scalar(select(m.Run))
        assert run.status == "done" and run.ladder_text == textwrap.dedent(LADDER) and len(run.ladder_sha256) == 64
        arms = {a.name: a for a in s.scalars(select(m.Arm))}
        assert arms["C0ctl"].config_hash == expected_hash() and arms["C0ctl"].role == "control"
        assert arms["A1seqs4"].config_hash == expected_hash(max_num_seqs=4)
        assert arms["A1seqs4"].change == {"flags": {"max-num-seqs": 4}, "env": {}}
        boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
        assert [b.status for b in boots] == ["done"] * 3
        for boot in boots:
            assert boot.booted_config_hash == boot.expected_config_hash
            assert boot.ready_s > 0 and boot.exit_status is not None and boot.stopped_by in ("SIGTERM", "exited")
            assert boot.engine_stats["kv_pool"]["tokens"] > 0 and boot.engine_stats["device"] == "cpu"
            assert boot.fingerprint["git_commit"] and boot.fingerprint["packages"]["torch"]
            assert Path(boot.log_path).exists()
        assert boots[1].engine_stats["config"]["max_num_seqs"] == 4
        metrics = set(s.scalars(select(m.Cell.metric).where(m.Cell.boot_id == boots[0].id)))
        assert metrics == {"latency_ms", "host_mem_available_floor_gib", "peak_memory_gib", "free_memory_gib",
                           "kv_pool_tokens", "kv_pool_gib"}
        pool = s.scalar(select(m.Cell).where(m.Cell.metric == "kv_pool_tokens", m.Cell.boot_id == boots[0].id))
        receipt = s.get_one(m.Request, pool.request_ids[0])
        assert receipt.endpoint == "/v1/stats" and receipt.response["kv_pool"]["tokens"] == pool.value
        assert s.scalar(select(m.Request).where(m.Request.endpoint == "/v1/completions")).completion_tokens == 1


def test_kill_9_mid_arm_then_resume_matches_the_uninterrupted_run(whole: Path, tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(textwrap.dedent(LADDER))
    victim = lab_process(["run", "tiny.yaml", "--name", "whole"], tmp_path, with_ping=True)
    boot = wait_for_steps(victim, tmp_path / "lab.db", slot_idx=1, count=1, timeout=240)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    code, out = finish(lab_process(["run", "--resume", "whole"], tmp_path, with_ping=True), timeout=300)
    assert code == 0, out
    assert not alive(boot.pid)
    got = cell_keys(open_store(str(tmp_path / "lab.db")))
    assert got == cell_keys(open_store(str(whole / "lab.db")))
    assert len(got) == len(set(got))


def test_boot_whose_config_differs_from_the_arm_is_refused(tmp_path: Path, lab) -> None:
    """Something outside the arm's knobs changes the engine's config: here a sitecustomize module
    on the arm's PYTHONPATH sets LAB_ENGINE_MAX_NUM_SEQS inside the engine process, after the lab
    stripped every inherited LAB_ENGINE_* variable. Only the /v1/stats hash check can catch it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['LAB_ENGINE_MAX_NUM_SEQS'] = '7'\n")
    # The arm changes a knob the variable does not set, so its boot is refused too.
    ladder = textwrap.dedent(LADDER).replace("{name: A1seqs4, flags: {max-num-seqs: 4}}", "{name: A1, flags: {seed: 1}}")
    ladder = ladder.replace("  ping: {steps: 3, delay_s: 0.3}\n", "").replace(
        "kv-cache-memory-bytes: 67108864}\n", f"kv-cache-memory-bytes: 67108864}}\n  env: {{PYTHONPATH: {site}}}\n")
    (tmp_path / "tiny.yaml").write_text(ladder)
    assert lab("run", "tiny.yaml") == 1  # no boot was measured
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        boots = s.scalars(select(m.Boot)).all()
        booted = engine_settings.from_sources({**BASE_FLAGS, "model": "smollm2-135m"},
                                              {"LAB_ENGINE_MAX_NUM_SEQS": "7"}).hash
        assert [b.status for b in boots] == ["refused"] * 3  # and the ladder went on to the next boot
        assert boots[0].reason == f"booted config hash {booted} != expected {expected_hash()}"
        assert boots[0].engine_stats["config"]["max_num_seqs"] == 7
        assert not s.scalars(select(m.Cell)).all()
        assert all(not psutil.pid_exists(b.pid) or psutil.Process(b.pid).status() == psutil.STATUS_ZOMBIE
                   for b in boots)
