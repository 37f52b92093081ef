"""Run a ladder through the real `lab run` in a subprocess and open its store (tests only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from lab.runner.parent_death import dies_with_parent
from lab.store.db import Store, open_store

REPO = Path(__file__).resolve().parents[2]


def run_ladder(cwd: Path, ladder: str, name: str, timeout: float, controls_only: bool = False) -> Store:
    """Write `ladder` (dedented) into `cwd`, run it as run `name`, and return its store. With
    `controls_only`, only each window's control boots, opened and closed (`lab sweep
    --control-only`): two boots of one config."""
    (cwd / f"{name}.yaml").write_text(textwrap.dedent(ladder))
    command = (["sweep", f"{name}.yaml", "--label", name, "--control-only"] if controls_only
               else ["run", f"{name}.yaml"])
    # The kernel sends `lab` SIGTERM if this test process dies, and `lab` stops its engine on it.
    lab = subprocess.Popen([sys.executable, "-m", "lab", *command, "--name", name], cwd=cwd,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, preexec_fn=dies_with_parent(signal.SIGTERM))
    try:
        out, _ = lab.communicate(timeout=timeout)
    finally:
        if lab.poll() is None:  # timed out, or the test was interrupted: `lab` stops its engine on SIGTERM
            lab.terminate()
            lab.wait()
    assert lab.returncode == 0, out
    return open_store(str(cwd / "lab.db"))
