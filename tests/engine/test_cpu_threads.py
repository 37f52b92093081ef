"""`--cpu-threads`: a knob like the others (flag, LAB_ENGINE_CPU_THREADS, ladder flag), out of the
config hash at its default, and a default read from the cores this process may use: its CPU
affinity and the CPU quota of its cgroup (v2 `cpu.max`, v1's cfs files), on the way up to the root."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lab.engine.core import cpu_threads
from lab.engine.core.config import ConfigError, EngineConfig, from_sources


def test_the_knob_is_a_flag_an_environment_variable_and_out_of_the_hash_at_its_default() -> None:
    assert from_sources({"cpu-threads": "3"}).cpu_threads == 3
    assert from_sources({}, {"LAB_ENGINE_CPU_THREADS": "2"}).cpu_threads == 2
    assert from_sources({"--cpu-threads": 1}, {"LAB_ENGINE_CPU_THREADS": "2"}).cpu_threads == 1  # the flag wins
    assert EngineConfig().hash == "4922fd059c13b7a9"  # computed before the knob existed
    assert EngineConfig(cpu_threads=1).hash != EngineConfig().hash
    with pytest.raises(ConfigError, match="--cpu-threads must be >= 0"):
        EngineConfig(cpu_threads=-1)


def test_the_default_leaves_one_usable_core_and_an_explicit_choice_wins() -> None:
    usable = cpu_threads.usable_cores()[0]
    default = cpu_threads.choose(0, "cpu", environ={})
    assert (default.intra_op, default.inter_op, default.source) == (max(1, usable - 1),) * 2 + ("usable cores - 1",)
    assert cpu_threads.choose(0, "cpu", environ={"OMP_NUM_THREADS": "3"}).source == "OMP_NUM_THREADS"
    explicit = cpu_threads.choose(5, "cpu", environ={"OMP_NUM_THREADS": "3"})
    assert (explicit.intra_op, explicit.source) == (5, "--cpu-threads")
    # On a GPU the host threads feed the device; torch's own choice stands unless asked.
    assert cpu_threads.choose(0, "cuda", environ={}).source == "torch default (cuda)"
    assert cpu_threads.choose(2, "cuda", environ={}).intra_op == 2


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "max 100000\n")
    write(root / "pod" / "cpu.max", "150000 100000\n")  # 1.5 cores
    write(root / "pod" / "job" / "cpu.max", "max 100000\n")
    proc = tmp_path / "proc-cgroup"
    write(proc, "0::/pod/job\n")
    assert cpu_threads.cgroup_quota_cores(root, proc) == 1.5
    write(proc, "0::/\n")
    assert cpu_threads.cgroup_quota_cores(root, proc) is None


def test_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct" / "docker" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc-cgroup"
    write(proc, "4:memory:/docker\n3:cpu,cpuacct:/docker\n0::/\n")
    assert cpu_threads.cgroup_quota_cores(root, proc) == 3.0


def test_a_process_pinned_to_one_core_counts_one_usable_core() -> None:
    code = ("import os, json\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from lab.engine.core import cpu_threads\n"
            "print(json.dumps(cpu_threads.choose(0, 'cpu', environ={}).to_dict()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    chosen = json.loads(out.stdout)
    assert chosen["affinity_cores"] == 1 and chosen["usable_cores"] == 1 and chosen["intra_op"] == 1


def test_apply_sets_the_pool_that_threads_started_later_use() -> None:
    """The server builds the engine on one thread and steps it on another: the count set on the
    first is the one the second runs with."""
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        set_on = threading.Thread(target=lambda: cpu_threads.apply(1, "cpu"))
        set_on.start()
        set_on.join()

        def step() -> None:
            torch.ones(256, 256) @ torch.ones(256, 256)
            seen.append(torch.get_num_threads())

        later = threading.Thread(target=step)
        later.start()
        later.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
