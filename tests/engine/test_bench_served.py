"""`lab engine bench --served`: the offline decode workloads again through the engine's own server,
booted as a subprocess and always stopped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

TINY = ("--prefill-lengths", "", "--decode-tokens", "6", "--prompt-tokens", "12", "--concurrency", "2",
        "--repeats", "1", "--reference", "none", "--device", "cpu", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(32 << 20))


def bench(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_ENGINE_")}
    return subprocess.run([sys.executable, "-m", "lab.engine", "bench", *TINY, "--log-level", "info", *extra],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


def served_port(stderr: str) -> int:
    match = re.search(r"booting the served engine on http://127\.0\.0\.1:(\d+)", stderr)
    assert match, stderr[-2000:]
    return int(match.group(1))


def engine_pids(port: int) -> list[int]:
    """Live (not zombie) engine servers on `port`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"serve" in argv and str(port).encode() in argv and state != "Z":
            pids.append(int(pid))
    return pids


def assert_stopped(port: int) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert not engine_pids(port), f"an engine on port {port} still runs"


def test_served_bench_prints_offline_and_served_figures_and_stops_its_server(smollm2_gguf: Path,
                                                                             tmp_path: Path) -> None:
    out_json, server_log = tmp_path / "bench.json", tmp_path / "server.log"
    done = bench(tmp_path, "--served", "--json", str(out_json), "--server-log", str(server_log))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lab served" in done.stdout and "served / lab" in done.stdout
    report = json.loads(out_json.read_text())
    assert report["server_log"] == str(server_log) and server_log.exists()
    figures = {f["name"]: f for f in report["figures"]}
    for name in ("decode batch 1", "decode batch 2 (aggregate)"):
        assert figures[name]["ours"] > 0 and figures[name]["served"] > 0, figures[name]
        assert len(figures[name]["served_runs"]) == 1
    # The served engine ran exactly the bench's knobs, or the bench would have refused it.
    assert_stopped(served_port(done.stderr))


def test_a_served_engine_that_is_not_ready_in_time_is_a_one_line_error_and_is_stopped(smollm2_gguf: Path,
                                                                                     tmp_path: Path) -> None:
    done = bench(tmp_path, "--served", "--server-timeout", "0.5")
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if x.startswith("lab engine bench: error:")]
    assert "did not answer /health in" in line
    assert_stopped(served_port(done.stderr))


def test_a_killed_bench_leaves_no_served_engine(smollm2_gguf: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_ENGINE_")}
    err = tmp_path / "bench.err"
    with open(err, "w") as out:
        bench_proc = subprocess.Popen([sys.executable, "-m", "lab.engine", "bench", *TINY, "--log-level", "info",
                                       "--served"], stdout=subprocess.DEVNULL, stderr=out, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 600
        while not (found := re.search(r"booting the served engine on http://127\.0\.0\.1:(\d+)", err.read_text())):
            assert bench_proc.poll() is None, err.read_text()[-2000:]
            assert time.monotonic() < deadline, "the bench never booted its engine"
            time.sleep(0.2)
        port = int(found.group(1))
        while not engine_pids(port):
            assert bench_proc.poll() is None, err.read_text()[-2000:]
            time.sleep(0.05)
        bench_proc.kill()  # SIGKILL: none of the bench's own cleanup runs
        bench_proc.wait()
        deadline = time.monotonic() + 30
        while engine_pids(port):
            assert time.monotonic() < deadline, "the served engine outlived its bench"
            time.sleep(0.2)
    finally:
        if bench_proc.poll() is None:
            bench_proc.kill()
            bench_proc.wait()


def test_bench_against_transformers_without_it_installed_is_a_one_line_error(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['transformers'] = None; from lab.engine.__main__ import main; "
            "sys.exit(main(['bench', '--model', 'dummy:smollm2-135m', '--reference', 'hf']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "lab engine bench: error: --reference hf needs transformers: pip install -e '.[bench]', or pass "
        "--reference none"]
