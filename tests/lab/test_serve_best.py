"""`lab serve --best`: the arm the KEEP rule kept, served exactly as measured; refusals in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lab.cli import main as lab_main
from lab.runner.parent_death import dies_with_parent
from lab.runner.boot import free_port
from tests.lab.conftest import REPO, stub_ladder

def lab_out(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}, timeout=60)


@pytest.mark.slow
def test_best_serves_the_kept_arm_and_answers_a_completion(kv_series: Path) -> None:
    port = free_port()
    # dies_with_parent: the served engine goes with this test process, however it ends.
    proc = subprocess.Popen([sys.executable, "-m", "lab", "serve", "--best", "kv", "--port", str(port)], cwd=kv_series,
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250",
                                 "LAB_ENGINE_MAX_NUM_SEQS": "3"},  # a stray export must not change the arm
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=dies_with_parent(signal.SIGTERM))
    try:
        answer = None
        deadline = time.monotonic() + 120
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                               json={"model": "dummy:tiny", "prompt": "Hello", "max_tokens": 4}, timeout=30)
                answer = r if r.status_code == 200 else None
            except httpx.HTTPError:
                time.sleep(0.5)
        assert answer is not None, f"no completion from `lab serve --best` (exit {proc.poll()})"
        assert answer.json()["usage"]["completion_tokens"] == 4
        stats = httpx.get(f"http://127.0.0.1:{port}/v1/stats", timeout=10).json()
        assert stats["config"]["kv_cache_memory_bytes"] == 16777216 and stats["config"]["max_num_seqs"] != 3
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "arm A1kv16m of run kv (window W1): keep (memory.kv_pool_tokens +100.0 %" in out
    assert "why this arm: the only arm kept" in out  # the rule `lab tune` names its winner by
    assert f"config hash {stats['config_hash']}" in out
    assert f"--port {port} --model dummy:tiny" in out


@pytest.mark.slow
def test_an_arm_not_kept_is_served_only_when_picked(kv_series: Path) -> None:
    picked = lab_out(kv_series, "serve", "--best", "kv", "--arm", "C0ctl", "--host", "0.0.0.0", "--port", "9100",
                     "--print")
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout.strip().endswith("--host 0.0.0.0 --port 9100 --model dummy:tiny --device cpu "
                                          "--max-model-len 512 --kv-cache-memory-bytes 8388608")
    unknown = lab_out(kv_series, "serve", "--best", "kv", "--arm", "A9")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == "lab: run kv has no arm 'A9'; its arms: C0ctl, A1kv16m"


def test_a_run_that_kept_nothing_is_refused_with_the_reasons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # A gate no boot can pass: the arm is rejected whatever the host does.
    ladder = stub_ladder(tmp_path, """\
        windows:
          - name: W1
            control: C0ctl
            arms:
              - {name: A1env, env: {STUB_ENV: B}}
        instruments:
          memory:
        keep:
          metrics: [memory.host_mem_available_floor_gib]
          gates: [{metric: memory.host_mem_available_floor_gib, max: 0}]
        """, env="{STUB_ENV: A}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    assert lab_main(["run", str(ladder), "--name", "gated"]) == 0
    capsys.readouterr()
    assert lab_main(["serve", "--best", "gated"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lab: run gated kept no arm (A1env: reject (gate memory.host_mem_available_floor_gib")
    assert err.endswith("; serve one anyway with --arm NAME") and "\n" not in err
    # A command engine is served from its stored recipe: the arm's environment and the command.
    assert lab_main(["serve", "--best", "gated", "--arm", "A1env", "--port", "9200", "--print"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("env STUB_ENV=B ") and line.endswith("--port 9200 --model stub")
