"""One engine process: start it in its own process group, wait for a real completion, stop it.

The lab only ever signals the process group it created (SIGTERM, then SIGKILL after a grace
period); it never looks processes up by name. The child's environment is the lab's own minus every
inherited LAB_ENGINE_* variable, plus exactly what the arm sets, so a stray export in the user's
shell cannot change an arm.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from lab.engine.settings import ENV_PREFIX

LOG_TAIL_LINES = 50


def free_port(ports: tuple[int, int] | None = None) -> int:
    """A port nothing listens on now: any the kernel gives, or one of `ports` (first, last) where a
    firewall or a second lab on the host confines the engines to a range; PortsBusy when none is free."""
    candidates = [0] if ports is None else random.sample(range(ports[0], ports[1] + 1), ports[1] - ports[0] + 1)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As the engine's server binds: a port the last boot left in TIME_WAIT is free again.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise PortsBusy(f"no free port in {ports[0]}-{ports[1]} (hygiene.ports)" if ports else "no free port")


class PortsBusy(OSError):
    """Every port the ladder allows is taken."""


def child_env(overrides: dict[str, str], base: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The child's environment and the inherited LAB_ENGINE_* names that were removed from it."""
    env = dict(os.environ if base is None else base)
    removed = sorted(k for k in env if k.startswith(ENV_PREFIX))
    for key in removed:
        del env[key]
    env.update(overrides)
    return env, removed


@dataclass(frozen=True)
class Ready:
    ok: bool
    seconds: float  # process start to the first answered completion (or to giving up)
    reason: str | None = None


@dataclass(frozen=True)
class Stopped:
    exit_status: int | None  # negative: killed by that signal
    stopped_by: str  # exited (before we asked) | SIGTERM | SIGKILL


class EngineProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_ns = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # A list argv, no shell: what is stored is exactly what ran.
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.started_ns = time.perf_counter_ns()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def create_time(self) -> float | None:
        try:
            return psutil.Process(self.pid).create_time()
        except psutil.Error:
            return None

    def exit_status(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def alive_after(self, grace_s: float) -> bool:
        """Alive once `grace_s` has passed or it has exited, whichever comes first: a process
        that dropped a connection by exiting may still be running when the client sees the
        connection close, for the moment the kernel takes to tear it down."""
        if self.proc is None:
            return False
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            return True
        return False

    def elapsed_s(self) -> float:
        return (time.perf_counter_ns() - self.started_ns) / 1e9

    def wait_ready(self, api_base: str, model: str, api_key: str | None, timeout_s: float,
                   on_poll: Callable[[float, str], None] | None = None, poll_s: float = 0.5) -> Ready:
        """Ready means a real completion was answered; /health alone proves only that HTTP is up."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        last = "no answer yet"
        # Retries start fast and back off to poll_s: a small engine listens within a fraction of a
        # second, and a boot should not wait out a whole interval after it.
        pause_s = min(0.05, poll_s)
        with httpx.Client(headers=headers) as client:
            while True:
                status = self.exit_status()
                if status is not None:
                    return Ready(False, self.elapsed_s(), f"engine exited with status {status} before it was ready")
                remaining = timeout_s - self.elapsed_s()
                if remaining <= 0:
                    return Ready(False, self.elapsed_s(), f"not ready after {timeout_s:g} s (last: {last})")
                try:
                    # The first completion may compile or load for a long time: wait the remaining budget for it.
                    response = client.post(f"{api_base}/completions", json=body,
                                           timeout=httpx.Timeout(remaining, connect=min(2.0, remaining)))
                    if response.status_code == 200:
                        return Ready(True, self.elapsed_s())
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                if on_poll:
                    on_poll(self.elapsed_s(), last)
                time.sleep(pause_s)
                pause_s = min(2 * pause_s, poll_s)

    def get_json(self, url: str, api_key: str | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        """(status, parsed JSON or None); (0, None) when nothing answered."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.get(url, headers=headers, timeout=timeout_s)
        except httpx.HTTPError:
            return 0, None
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, None

    def stop(self, grace_s: float) -> Stopped:
        """SIGTERM to the group, SIGKILL to the group after `grace_s` if anything in it still runs."""
        if self.proc is None:
            return Stopped(None, "exited")
        pgid = self.proc.pid  # start_new_session made the child its group's leader
        stopped_by = "exited"
        if self.alive() or group_alive(pgid):
            stopped_by = _stop_group(pgid, grace_s, lambda: self.alive() or group_alive(pgid))
        status = self.proc.wait()
        return Stopped(status, stopped_by)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(deque(f, maxlen=lines)).decode("utf-8", errors="replace")
    except OSError:
        return ""


def group_alive(pgid: int) -> bool:
    """Whether any process other than a zombie is still in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def stop_orphan(pid: int, created: float | None, grace_s: float) -> bool:
    """Stop the process group of an engine a killed `lab run` left behind.

    Only when the pid still belongs to the process we started (same create time), and only its group.
    """
    try:
        proc = psutil.Process(pid)
        if created is None or abs(proc.create_time() - created) > 0.01 or os.getpgid(pid) != pid:
            return False
    except (psutil.Error, ProcessLookupError):
        return False
    _stop_group(pid, grace_s, lambda: group_alive(pid))
    return True


def _stop_group(pgid: int, grace_s: float, running: Callable[[], bool]) -> str:
    """SIGTERM to the group, SIGKILL to it if `running()` still after `grace_s`; the last signal sent."""
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and running():
        time.sleep(0.05)
    if running():
        _killpg(pgid, signal.SIGKILL)
        return "SIGKILL"
    return "SIGTERM"


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
