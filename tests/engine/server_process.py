"""Start the real engine server in a subprocess for tests, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from lab.runner.parent_death import dies_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/stats", timeout=10).json()

    def log_text(self) -> str:
        return self.log.read_text()


@contextmanager
def engine_server(tmp: Path, *flags: str, env: dict[str, str] | None = None,
                  timeout: float = 120) -> Iterator[ServerProcess]:
    port = free_port()
    log = tmp / f"engine-{port}.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_ENGINE_")}
    child_env.update(env or {})
    with open(log, "w") as out:
        # SIGTERM from the kernel if the test process dies before its `finally` runs.
        proc = subprocess.Popen([sys.executable, "-m", "lab.engine", "serve", "--port", str(port), *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                                preexec_fn=dies_with_parent(signal.SIGTERM))
    server = ServerProcess(proc, port, log)
    try:
        wait_healthy(proc, server.url, log, timeout, "engine")
        yield server
    finally:
        stop_group(proc)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float, what: str) -> None:
    """Block until `url`/health answers 200; a process that exits or never answers is an error
    carrying the tail of its log."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout} s: {log.read_text()[-2000:]}")
        time.sleep(0.05)  # connection refused costs nothing; ready is noticed within 50 ms


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process's group (it was started in a session of its own), SIGKILL after 10 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
