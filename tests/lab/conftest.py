"""Helpers for lab tests: ladders that run the stub engine, and `lab` run in-process or as a process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab.cli import main as lab_main
from lab.runner.parent_death import dies_with_parent
from lab.store.db import open_store

REPO = Path(__file__).resolve().parents[2]
STUB = Path(__file__).with_name("stub_engine.py")


def stub_ladder(tmp_path: Path, body: str, *, name: str = "stub", **engine: object) -> Path:
    """A ladder whose engine is the stub server; `body` holds windows/instruments/hygiene YAML."""
    settings = {"ready_timeout_s": 10, "stop_grace_s": 2, **engine}
    lines = "".join(f"  {key}: {value}\n" for key, value in settings.items())
    text = (f"name: {name}\n"
            "engine:\n"
            "  kind: command\n"
            f'  command: [{sys.executable}, {STUB}, --port, "{{port}}", --model, "{{model}}"]\n'
            "  model: stub\n"
            f"{lines}") + textwrap.dedent(body)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run `lab ARGS` in-process from tmp_path (store ./lab.db, logs ./runs); returns the exit status."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables at 80 columns when not on a terminal

    def run(*args: str) -> int:
        return lab_main(list(args))

    return run


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(str(tmp_path / "lab.db"))
    yield s
    s.close()


# kv_pool_tokens is set by the arm's memory budget, so the verdict is certain: twice the pool is kept.
KV_LADDER = """\
    name: kv
    engine:
      kind: bundled
      model: dummy:tiny
      flags: {device: cpu, max-model-len: 512, kv-cache-memory-bytes: 8388608}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1kv16m, flags: {kv-cache-memory-bytes: 16777216}}
    instruments:
      memory:
    keep:
      metrics: [memory.kv_pool_tokens]
    """
KV_LABELS = ("2026-01-01", "2026-01-02", "2026-01-03")


@pytest.fixture(scope="session")
def kv_series(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One series of three `lab sweep` labels of KV_LADDER in ./lab.db: the first runs the whole ladder
    as run `kv` (three dummy:tiny boots, A1kv16m kept), the other two its control alone (two boots
    each). `lab serve --best` reads the first run; `lab history` the whole series."""
    cwd = tmp_path_factory.mktemp("kv")
    (cwd / "kv.yaml").write_text(textwrap.dedent(KV_LADDER))
    for label in KV_LABELS:
        extra = ["--name", "kv"] if label == KV_LABELS[0] else ["--control-only"]
        code = lab_main(["sweep", str(cwd / "kv.yaml"), "--label", label, *extra,
                         "--db", str(cwd / "lab.db"), "--runs-dir", str(cwd / "runs")])
        assert code == 0
    return cwd


def lab_process(args: list[str], cwd: Path, with_ping: bool = False) -> subprocess.Popen[bytes]:
    """`lab` as its own process (for kill -9); `with_ping` adds the test-only multi-step instrument.
    It gets SIGTERM from the kernel if the test process dies first (lab/runner/parent_death.py)."""
    entry = ["-m", "tests.lab.lab_with_ping"] if with_ping else ["-m", "lab"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, *entry, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=dies_with_parent(signal.SIGTERM))
