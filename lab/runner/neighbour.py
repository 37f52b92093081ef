"""The ladder's noisy neighbour (`hygiene.neighbour`): another tenant's job beside each measured boot.

It is started before the boot's engine, in its own process group, pinned to its CPUs before its
program runs (so it and anything it starts stay there), its output in the boot's log folder, and
stopped (SIGTERM to its group, SIGKILL after a grace) once the boot has ended, however it ended.
A `lab run` killed outright takes it along (`lab.runner.parent_death`). What ran, where, and its
process id are stored in the boot's fingerprint under `neighbour`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from lab.ladder.ladder import Neighbour
from lab.runner.boot import group_alive
from lab.runner.errors import signals_held
from lab.runner.parent_death import dies_with_parent

log = logging.getLogger("lab.run")
STOP_GRACE_S = 5.0


@contextmanager
def beside(neighbour: Neighbour, log_path: Path) -> Iterator[dict[str, Any]]:
    """Run the neighbour for the duration of the block; yields what the boot stores of it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    arm_parent_death = dies_with_parent()
    cpus = set(neighbour.cpus) if neighbour.cpus else None

    def before_exec() -> None:
        if arm_parent_death is not None:
            arm_parent_death()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(log_path, "ab") as out, signals_held():
            proc = subprocess.Popen(neighbour.command, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=before_exec)
        log.info("neighbour %s started (pid %d%s)", neighbour.command, proc.pid,
                 f", CPUs {sorted(cpus)}" if cpus else "")
        yield {"argv": list(neighbour.command), "cpus": neighbour.cpus, "pid": proc.pid, "log_path": str(log_path)}
    finally:
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the neighbour's group, SIGKILL to it if anything of it is left after the grace."""
    pgid = proc.pid  # start_new_session made it its group's leader
    _killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None or group_alive(pgid):
        _killpg(pgid, signal.SIGKILL)
    proc.wait()
    log.info("neighbour pid %d stopped (exit status %s)", proc.pid, proc.returncode)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
