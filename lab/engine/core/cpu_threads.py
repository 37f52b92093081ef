"""How many threads torch's CPU kernels use: `--cpu-threads`, or a default that leaves the host a core.

torch sizes its intra-op pool from the machine's core count, not from the cores this process may
use (its CPU affinity, a container's CPU quota), and a decode step of a small model is a few
hundred short OpenMP parallel regions, each ending at a barrier that waits for its slowest thread.
When another process holds one of those cores, every barrier waits for the OS to hand the core
back, and per-stream decode falls by an order of magnitude (docs/server.md, "CPU threads", has
the measurement). The default therefore counts the cores this process may use and leaves one of
them to the rest of the host (the server's own event loop, other processes): a thread too many
costs a shared host most of its speed, a thread fewer costs a quiet one at most what that thread
would have added.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuThreads:
    """What the engine set, and why (reported at /v1/stats)."""
    intra_op: int
    inter_op: int
    source: str  # "--cpu-threads", "OMP_NUM_THREADS", "usable cores - 1", or "torch default (cuda)"
    usable_cores: int
    affinity_cores: int
    cgroup_quota_cores: float | None  # the CPU quota of this process's cgroup, in cores; None: no quota

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def affinity_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _quota_of(directory: Path) -> float | None:
    """The CPU quota set on one cgroup directory, in cores (v2 `cpu.max`, or v1's cfs files)."""
    try:
        text = (directory / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota on this process's cgroup or any cgroup above it, in cores; None
    when none is set. A container usually sees its own cgroup as the root (`0::/`)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base = root
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            base = next((root / d for d in ("cpu,cpuacct", "cpu") if (root / d).is_dir()), None)
            if base is None:
                continue
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            candidates.append(here)
            if here == base:
                break
            here = here.parent
    quotas = [q for q in (_quota_of(d) for d in candidates or [root]) if q is not None]
    return min(quotas) if quotas else None


def usable_cores() -> tuple[int, int, float | None]:
    """(cores this process may use, its affinity's cores, its cgroup quota in cores)."""
    affinity = affinity_cores()
    quota = cgroup_quota_cores()
    usable = affinity if quota is None else min(affinity, max(1, math.ceil(quota)))
    return usable, affinity, quota


def choose(requested: int, device_type: str, environ: dict[str, str] | None = None) -> CpuThreads:
    """The thread counts for `--cpu-threads requested` (0 = the default) on this host."""
    environ = dict(os.environ if environ is None else environ)
    usable, affinity, quota = usable_cores()

    def result(intra: int, source: str) -> CpuThreads:
        return CpuThreads(intra, intra, source, usable, affinity, quota)

    if requested > 0:
        return result(requested, "--cpu-threads")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return result(int(omp), "OMP_NUM_THREADS")
    if device_type != "cpu":
        # On a GPU the host's threads feed the device; torch's own default is left as it is.
        return CpuThreads(torch.get_num_threads(), torch.get_num_interop_threads(), "torch default (cuda)",
                          usable, affinity, quota)
    return result(max(1, usable - 1), "usable cores - 1")


def apply(requested: int, device_type: str) -> CpuThreads:
    """Set torch's thread pools for this process and say what was set. The intra-op count is
    process-wide (threads that run torch later, the engine's step loop, pick it up); the inter-op
    pool can only be sized before its first use, after which it keeps the size it has."""
    chosen = choose(requested, device_type)
    if chosen.source == "torch default (cuda)":
        return chosen
    torch.set_num_threads(chosen.intra_op)
    try:
        torch.set_num_interop_threads(chosen.inter_op)
    except RuntimeError:  # already started in this process (a second engine, tests)
        pass
    threads = CpuThreads(torch.get_num_threads(), torch.get_num_interop_threads(), chosen.source,
                         chosen.usable_cores, chosen.affinity_cores, chosen.cgroup_quota_cores)
    log.info("CPU threads: %d intra-op, %d inter-op (%s; %d usable cores: affinity %d, cgroup quota %s)",
             threads.intra_op, threads.inter_op, threads.source, threads.usable_cores, threads.affinity_cores,
             "none" if threads.cgroup_quota_cores is None else f"{threads.cgroup_quota_cores:g}")
    return threads
