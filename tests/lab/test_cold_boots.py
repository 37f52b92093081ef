"""Which boots of a bundled-engine run are cold: those whose engine built a cache a later boot
reuses, read at ready and again before the engine stops. Random weights build nothing, so a
`dummy:` run on the CPU is warm throughout and every measured cell counts; a boot that compiles
a kernel while it is measured turns cold, `lab ls` says why, and its verdict leaves it out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import Store, open_store
from tests.lab.conftest import REPO, lab_process
from tests.lab.test_resume import finish, stop_left_engines, wait_for_steps

pytestmark = pytest.mark.slow

LADDER = """\
    name: cold
    engine:
      kind: bundled
      model: dummy:tiny  # the few-layer shape: a boot's random weights take no time to draw
      # F.linear throughout: no product layouts to measure, whose file would make the first boot cold
      flags: {device: cpu, max-model-len: 256, kv-cache-memory-bytes: 33554432, cpu-products: linear}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1seqs4, flags: {max-num-seqs: 4}}
          - {name: A2seqs8, flags: {max-num-seqs: 8}}
    instruments:
      ping: {steps: 3, delay_s: 0.5}  # A2's two steps after its first leave the test a second to add the kernel
      memory:
    keep:
      metrics: [memory.peak_memory_gib]
    hygiene: {min_mem_available_gib: 1, warmup_boot: true}
    """
A2_SLOT = 3  # warm-up, C0ctl (open), A1seqs4, A2seqs8, C0ctl (close)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Store]:
    """The ladder run as a process with its own Triton and weight cache directories; while A2's
    engine is measured, a kernel directory lands in the Triton cache, as a compile writes it."""
    cwd = tmp_path_factory.mktemp("cold")
    (cwd / "cold.yaml").write_text(textwrap.dedent(LADDER))
    triton = cwd / "triton"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_CACHE_DIR", str(triton))
        env.setenv("LAB_CACHE_DIR", str(cwd / "lab-cache"))
        proc = lab_process(["run", "cold.yaml", "--name", "cold"], cwd, with_ping=True)
    try:
        wait_for_steps(proc, cwd / "lab.db", slot_idx=A2_SLOT, count=1, timeout=300)
        (triton / "4UQOPB3TK6Z2WXZ5NQBGVTYDQ7JHFXKX4JEJNFE3RHJ3CP7NSO3Q").mkdir(parents=True)
        code, out = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_left_engines(cwd / "lab.db")
    assert code == 0, out
    return cwd, open_store(str(cwd / "lab.db"))


def boots(store: Store) -> dict[str, m.Boot]:
    with store.session() as s:
        rows = s.execute(select(m.Slot, m.Boot).join(m.Boot, m.Boot.slot_id == m.Slot.id).order_by(m.Slot.idx)).all()
        return {f"{slot.arm.name}/{slot.position}": boot for slot, boot in rows}


def verdict(store: Store, arm: str) -> m.Verdict:
    with store.session() as s:
        return s.scalar(select(m.Verdict).join(m.Arm, m.Verdict.arm_id == m.Arm.id).where(m.Arm.name == arm))


def test_random_weights_build_nothing_so_the_warm_up_and_later_boots_are_warm(run) -> None:
    _, store = run
    got = boots(store)
    assert list(got) == ["C0ctl/warmup", "C0ctl/open", "A1seqs4/arm", "A2seqs8/arm", "C0ctl/close"]
    for label, boot in got.items():
        assert boot.status == "done", label
        assert boot.engine_stats["random_weights"] is True, label
        if label != "A2seqs8/arm":
            assert boot.cold is False and boot.reason is None, label
            assert boot.engine_stats["caches_built"] == boot.engine_stats["caches_built_before_stop"] == [], label


def test_warm_boots_cells_count_in_the_verdict(run) -> None:
    _, store = run
    detail = verdict(store, "A1seqs4").detail
    assert detail["excluded_boots"] == []
    assert not [r for r in detail["reasons"] if "cold" in r]
    (row,) = detail["metrics"]
    assert row["arm_value"] is not None and len(row["control_values"]) == 2  # both controls and the arm


def test_a_kernel_compiled_while_measured_makes_the_boot_cold_and_lab_ls_says_why(run) -> None:
    cwd, store = run
    a2 = boots(store)["A2seqs8/arm"]
    triton = str(cwd / "triton")
    assert a2.cold is True
    assert a2.engine_stats["caches_built"] == []  # warm when it answered its first completion
    assert a2.engine_stats["caches_built_before_stop"] == [{"cache": "triton", "path": triton, "entries_added": 1, "cold": True}]
    assert a2.reason == "cold: built 1 entry of the triton cache after ready"
    listing = subprocess.run([sys.executable, "-m", "lab", "ls", "cold"], cwd=cwd, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"}, check=True).stdout
    (line,) = [ln for ln in listing.splitlines() if "A2seqs8" in ln and "done" in ln]
    assert "cold" in line and "1 entry of the triton cache after ready" in line


def test_the_cold_boot_is_left_out_of_its_verdict(run) -> None:
    _, store = run
    v = verdict(store, "A2seqs8")
    assert v.decision == "inconclusive"
    assert "arm boot A2seqs8 booted cold: excluded from the verdict" in v.reasons
