"""One engine process: start it in its own process group, wait for a real completion, stop it.

The lab only ever signals the process group it created (SIGTERM, then SIGKILL after a grace
period); it never looks processes up by name. The child's environment is the lab's own minus every
inherited LAB_ENGINE_* variable, plus exactly what the arm sets, so a stray export in the user's
shell cannot change an arm.
"""

from __future__ import annotations

import asyncio
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
from lab.runner.errors import signals_held
from lab.runner.parent_death import dies_with_parent

LOG_TAIL_LINES = 50
# How often a readiness probe in flight looks whether the engine has exited meanwhile.
EXIT_POLL_S = 0.1


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
        self._created: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # A list argv, no shell: what is stored is exactly what ran. The engine gets SIGTERM
            # from the kernel if the lab dies without stopping it (parent_death): started on the
            # lab's main thread, which lives as long as the lab.
            with signals_held():
                self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=dies_with_parent(signal.SIGTERM))
        self.started_ns = time.perf_counter_ns()
        try:  # read now: once the engine has exited and been reaped, its pid tells nothing
            self._created = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            self._created = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def create_time(self) -> float | None:
        return self._created

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
        """Ready means a real completion was answered; /health alone proves only that HTTP is up.
        An engine that exits while a probe is in flight is noticed at once, even when something
        else holds its port and never answers."""
        return asyncio.run(self.await_ready(api_base, model, api_key, timeout_s, on_poll, poll_s))

    async def await_ready(self, api_base: str, model: str, api_key: str | None, timeout_s: float,
                          on_poll: Callable[[float, str], None] | None = None, poll_s: float = 0.5) -> Ready:
        """`wait_ready` inside a running event loop."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        last = "no answer yet"
        # Retries start fast and back off to poll_s: a small engine listens within a fraction of a
        # second, and a boot should not wait out a whole interval after it.
        pause_s = min(0.05, poll_s)
        async with httpx.AsyncClient(headers=headers) as client:
            while True:
                exited = self._exited_before_ready()
                if exited:
                    return exited
                remaining = timeout_s - self.elapsed_s()
                if remaining <= 0:
                    return Ready(False, self.elapsed_s(), f"not ready after {timeout_s:g} s (last: {last})")
                # The first completion may compile or load for a long time: wait the remaining budget for it.
                limits = httpx.Timeout(remaining, connect=min(2.0, remaining))
                probe = asyncio.ensure_future(client.post(f"{api_base}/completions", json=body, timeout=limits))
                while not probe.done():
                    await asyncio.wait({probe}, timeout=EXIT_POLL_S)
                    if not probe.done() and self.exit_status() is not None:
                        probe.cancel()
                        await asyncio.gather(probe, return_exceptions=True)
                        return self._exited_before_ready()  # type: ignore[return-value]
                try:
                    response = probe.result()
                    if response.status_code == 200:
                        return Ready(True, self.elapsed_s())
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                if on_poll:
                    on_poll(self.elapsed_s(), last)
                await asyncio.sleep(pause_s)
                pause_s = min(2 * pause_s, poll_s)

    def _exited_before_ready(self) -> Ready | None:
        status = self.exit_status()
        if status is None:
            return None
        return Ready(False, self.elapsed_s(), f"engine {describe_exit(status)} before it was ready")

    def silent(self, api_base: str, model: str, api_key: str | None, timeout_s: float) -> str | None:
        """Why the engine does not answer a 1-token completion within `timeout_s` (no bytes of an
        answer at all), or None when it answers anything, an error status included."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        try:
            httpx.post(f"{api_base}/completions", json=body, headers=headers, timeout=timeout_s)
        except httpx.TimeoutException:
            return f"a 1-token completion got no answer in {timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"a 1-token completion failed: {type(exc).__name__}"
        return None

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


def describe_exit(status: int | None) -> str:
    """`exited with status 3`, or `was killed by SIGKILL` for a negative (signal) status."""
    if status is not None and status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            pass
    return f"exited with status {status}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(deque(f, maxlen=lines)).decode("utf-8", errors="replace")
    except OSError:
        return ""


def port_taken(port: int, proc: EngineProcess) -> str | None:
    """Why `port` is not the engine's, or None. The lab picks a free port and lets it go before the
    engine binds it; in between another process may take it, and the lab would then be talking to
    that process or waiting on it. Seen as a process listening on the port that is outside the
    engine's process group and was already running when the engine started (a listener the engine
    started later, docker's proxy for one, is the engine's), or, where other users' processes
    cannot be seen, as an engine that exited saying its address was in use."""
    holder = _listener(port)
    created = proc.create_time()
    if holder is not None and created is not None:
        try:
            if os.getpgid(holder.pid) != proc.pid and holder.create_time() <= created:
                return (f"port {port} was taken by another process (pid {holder.pid}, {holder.name()}) before the "
                        "engine could listen on it")
        except (psutil.Error, ProcessLookupError):
            pass
    if proc.exit_status() is not None and "address already in use" in proc.log_tail().lower():
        return f"port {port} was taken by another process before the engine could listen on it (address already in use)"
    return None


def _listener(port: int) -> psutil.Process | None:
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid is not None:
            try:
                return psutil.Process(conn.pid)
            except psutil.Error:
                return None
    return None


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
    stop_group(pid, grace_s)
    return True


def stop_group(pgid: int, grace_s: float) -> str:
    """SIGTERM to a process group the lab started, SIGKILL to it after `grace_s` if any of it still runs."""
    return _stop_group(pgid, grace_s, lambda: group_alive(pgid))


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
