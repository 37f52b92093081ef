"""What a run, a sweep or a tune stops on: their own module, so that the `lab` command can catch
it without importing the runner (and, through it, the analysis and scipy) for commands that only read."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


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
