"""The runner's hold on a boot's engine process, lent to instruments (`BootContext.engine`): restart
the engine with the same argv and environment, or stop it for `lab engine bench` on the same
config and start it again. The boot stays one boot: its process id is updated in the store, its
log gets the restarted engine's output, and the booted config is checked again at every start."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lab.ladder.engines import Launch
from lab.runner.errors import signals_held
from lab.runner.parent_death import dies_with_parent
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
        started = time.perf_counter()
        self.status("restarting the engine")
        await asyncio.to_thread(self.proc.stop, self.stop_grace_s)
        await self._start_again()
        return time.perf_counter() - started

    async def offline(self, args: list[str]) -> dict[str, Any]:
        if self.offline_argv is None:
            raise NotImplementedError("offline figures need the bundled engine's `lab engine bench`")
        self.status("stopping the engine for offline figures")
        await asyncio.to_thread(self.proc.stop, self.stop_grace_s)
        with tempfile.TemporaryDirectory(prefix="lab-offline-") as tmp:
            out = Path(tmp) / "bench.json"
            argv = [*self.offline_argv, *args, "--json", str(out)]
            log.info("offline: %s", " ".join(argv))
            self.status("lab engine bench on the same config")
            with open(self.proc.log_path, "ab") as engine_log:
                engine_log.write(f"\n== lab engine bench: {' '.join(argv)}\n".encode())
                engine_log.flush()
                bench: subprocess.Popen[bytes] | None = None
                try:
                    with signals_held():
                        bench = subprocess.Popen(argv, env=self.proc.env, stdin=subprocess.DEVNULL,
                                                 stdout=engine_log, stderr=subprocess.STDOUT, start_new_session=True,
                                                 preexec_fn=dies_with_parent(signal.SIGTERM))
                    code: int | None = await asyncio.wait_for(_exit_status(bench), 3 * self.ready_timeout_s)
                except asyncio.TimeoutError:
                    code = None
                finally:  # timed out, or the lab is being stopped: the bench's group goes too
                    if bench is not None:
                        if bench.poll() is None:
                            stop_group(bench.pid, self.stop_grace_s)
                        bench.wait()
            figures = json.loads(out.read_text()) if code == 0 and out.exists() else None
        await self._start_again()
        if figures is None:
            raise RuntimeError(f"lab engine bench {'timed out' if code is None else f'exited with {code}'}; "
                               f"its output is in {self.proc.log_path}")
        return figures

    async def _start_again(self) -> None:
        # Started from the event loop's thread, the main one: no worker thread that ends takes the
        # engine's parent-death signal with it, and a stop signal never waits on one.
        with open(self.proc.log_path, "ab") as engine_log:
            engine_log.write(b"\n== the lab restarts the engine\n")
        self.proc.start()
        self.restarts += 1
        writer.update_boot(self.store, self.boot_id, pid=self.proc.pid, pid_started=self.proc.create_time())
        ready = await self.proc.await_ready(self.spec.api_base, self.spec.model, self.spec.api_key,
                                            self.ready_timeout_s)
        if not ready.ok:
            raise EngineGone(f"the engine did not come back after a restart: {ready.reason}")
        if self.spec.expected_config_hash is not None:
            status, stats = await asyncio.to_thread(self.proc.get_json, f"{self.spec.base_url}/v1/stats")
            booted = stats.get("config_hash") if status == 200 and isinstance(stats, dict) else None
            if booted != self.spec.expected_config_hash:
                await asyncio.to_thread(self.proc.stop, self.stop_grace_s)
                raise EngineGone(f"the restarted engine booted config {booted}, not {self.spec.expected_config_hash}")


async def _exit_status(proc: subprocess.Popen[bytes]) -> int:
    """`proc`'s exit status once it has exited, waiting without holding a thread."""
    while proc.poll() is None:
        await asyncio.sleep(0.2)
    return proc.returncode
