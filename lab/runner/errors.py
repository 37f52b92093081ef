"""What a run, a sweep or a tune stops on: their own module, so that the `lab` command can catch
it without importing the runner (and, through it, the analysis and scipy) for commands that only read."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class RunError(RuntimeError):
    """The run cannot go on; one line a person can act on."""


class Interrupted(BaseException):
    """`lab run` was asked to stop (Ctrl-C or SIGTERM); the slot stays pending for --resume."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within it, SIGTERM raises Interrupted as Ctrl-C raises KeyboardInterrupt, so a `lab` command
    told to stop unwinds: it stops the engine it owns and leaves its run or trial resumable."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the engine's stop short
        raise Interrupted()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held() -> Iterator[None]:
    """Within it, Ctrl-C and a SIGTERM that `stop_on_sigterm` handles wait, and act as the block ends.

    Around starting a child: the exception a signal raises while `subprocess` forks runs in the
    fork's own callbacks (logging's lock), where Python prints and drops it, and the lab would go
    on as if never told to stop; raised while Popen waits for the exec, it would leave a child that
    no caller holds, so no one stops it. Held, it is raised once the caller has the child."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):  # SIG_DFL and SIG_IGN stay as they are
            previous[signum] = signal.signal(signum, lambda got, frame: arrived.append(got))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            previous[signum](signum, None)
