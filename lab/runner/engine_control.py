"""The runner's hold on a boot's engine process, lent to instruments (`BootContext.engine`): restart
the engine with the same argv and environment, or stop it for `lab engine bench` on the same
config and start it again. The boot stays one boot: its process id is updated in the store, its
log gets the restarted engine's output, and the booted config is checked again at every start."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lab.ladder.engines import Launch
from lab.runner import parent_death
from lab.runner.boot import EngineProcess, stop_group
from lab.store import writer
from lab.store.db import Store

log = logging.getLogger("lab.run")


class EngineGone(RuntimeError):
    """The engine did not come back after a restart; the boot ends as died."""


class ProcessControl:
    def __init__(self, store: Store, boot_id: int, proc: EngineProcess, spec: Launch, ready_timeout_s: float,
                 stop_grace_s: float, offline_argv: list[str] | None,
                 status: Callable[[str], None] = lambda text: None) -> None:
        self.store = store
        self.boot_id = boot_id
        self.proc = proc
        self.spec = spec
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.offline_argv = offline_argv
        self.status = status
        self.restarts = 0

    async def restart(self) -> float:
        return await asyncio.to_thread(self._restart)

    async def offline(self, args: list[str]) -> dict[str, Any]:
        if self.offline_argv is None:
            raise NotImplementedError("offline figures need the bundled engine's `lab engine bench`")
        return await asyncio.to_thread(self._offline, args)

    def _restart(self) -> float:
        started = time.perf_counter()
        self.status("restarting the engine")
        self.proc.stop(self.stop_grace_s)
        self._start_again()
        return time.perf_counter() - started

    def _offline(self, args: list[str]) -> dict[str, Any]:
        assert self.offline_argv is not None
        self.status("stopping the engine for offline figures")
        self.proc.stop(self.stop_grace_s)
        with tempfile.TemporaryDirectory(prefix="lab-offline-") as tmp:
            out = Path(tmp) / "bench.json"
            argv = [*self.offline_argv, *args, "--json", str(out)]
            log.info("offline: %s", " ".join(argv))
            self.status("lab engine bench on the same config")
            with open(self.proc.log_path, "ab") as engine_log:
                engine_log.write(f"\n== lab engine bench: {' '.join(argv)}\n".encode())
                engine_log.flush()
                bench = parent_death.popen(argv, env=self.proc.env, stdin=subprocess.DEVNULL, stdout=engine_log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    code: int | None = bench.wait(3 * self.ready_timeout_s)
                except BaseException as exc:
                    # Timed out, or the lab is being stopped: the bench's group goes (SIGTERM, then SIGKILL).
                    stop_group(bench.pid, self.stop_grace_s)
                    bench.wait()
                    if not isinstance(exc, subprocess.TimeoutExpired):
                        raise
                    code = None
            figures = json.loads(out.read_text()) if code == 0 and out.exists() else None
        self._start_again()
        if figures is None:
            raise RuntimeError(f"lab engine bench {'timed out' if code is None else f'exited with {code}'}; "
                               f"its output is in {self.proc.log_path}")
        return figures

    def _start_again(self) -> None:
        with open(self.proc.log_path, "ab") as engine_log:
            engine_log.write(b"\n== the lab restarts the engine\n")
        self.proc.start()
        self.restarts += 1
        writer.update_boot(self.store, self.boot_id, pid=self.proc.pid, pid_started=self.proc.create_time())
        ready = self.proc.wait_ready(self.spec.api_base, self.spec.model, self.spec.api_key, self.ready_timeout_s)
        if not ready.ok:
            raise EngineGone(f"the engine did not come back after a restart: {ready.reason}")
        if self.spec.expected_config_hash is not None:
            status, stats = self.proc.get_json(f"{self.spec.base_url}/v1/stats")
            booted = stats.get("config_hash") if status == 200 and isinstance(stats, dict) else None
            if booted != self.spec.expected_config_hash:
                self.proc.stop(self.stop_grace_s)
                raise EngineGone(f"the restarted engine booted config {booted}, not {self.spec.expected_config_hash}")
