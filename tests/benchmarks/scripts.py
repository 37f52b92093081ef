"""Runs a script of `benchmarks/` as a user would, in a child process from the repository root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NUMBER = r"[-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?"


def run_script(path: str, *args: str, interpret: bool = False, timeout: float = 600) -> str:
    """stdout of `python benchmarks/PATH ARGS`, which must exit 0; `interpret` runs Triton's
    kernels in its CPU interpreter (TRITON_INTERPRET=1, read when a kernel module is imported)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(BENCHMARKS / path), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def numbers(line: str) -> list[float]:
    """Every number in a line of output, in order (thousands separators dropped)."""
    return [float(n.replace(",", "")) for n in re.findall(NUMBER, line)]
