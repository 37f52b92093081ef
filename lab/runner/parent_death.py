"""Children of the lab die with it: every process the lab starts (an engine, `lab engine bench`) is
asked to receive SIGTERM from the kernel when the lab process dies, however it dies (SIGKILL from a
CI timeout included), so no engine keeps serving after the `lab` that started it is gone.

Linux sends the parent-death signal when the *thread* that forked the child exits, not the process.
A child forked on a short-lived thread (an `asyncio.to_thread` worker, which `asyncio.run` joins
when it returns) would get SIGTERM as soon as that thread ends. So children are forked on the main
thread, or, when `popen` is called from any other thread, on one spawner thread that lives as long
as the process. Elsewhere than Linux there is no such signal: the lab's own `finally` blocks and
`lab run --resume` are then the only guards.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **kwargs)` whose child gets SIGTERM when this process dies."""
    if threading.current_thread() is threading.main_thread():
        return _popen(argv, kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="lab-spawner")
    return _spawner.submit(_popen, argv, kwargs).result()


def _popen(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
    if _LIBC is None:
        return subprocess.Popen(argv, **kwargs)
    return subprocess.Popen(argv, preexec_fn=_die_with(os.getpid()), **kwargs)


def _die_with(parent: int) -> Callable[[], None]:
    prctl = _LIBC.prctl  # looked up before the fork: the child runs as little as it can
    term = int(signal.SIGTERM)

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:  # the lab died between the fork and the prctl
            os.kill(os.getpid(), term)

    return in_child
