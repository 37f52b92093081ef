"""Children that end with the `lab run` that started them, even when it is killed outright (kill -9).

A killed `lab run` runs no cleanup of its own, so the kernel has to do it: on Linux,
`prctl(PR_SET_PDEATHSIG)` in the child, between fork and exec, asks for a signal to the child the
moment its parent goes away. Two things to know when using it:

- the "parent" is the thread that started the child: start it from a thread that outlives it
  (`lab run` starts and stops each boot's processes on one thread, inside one call);
- the signal reaches the child the lab started, not processes that child starts in turn.

Elsewhere there is no such request, and a child outlives a killed lab as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1
# Looked up once, here: the function a child calls between fork and exec must need no loading.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def dies_with_parent(sig: signal.Signals = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when the thread calling this exits.
    None where the platform has no such request."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def request() -> None:
        if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
        if os.getppid() != parent:  # the parent died before the request was made: it would never come
            os.kill(os.getpid(), sig)

    return request
