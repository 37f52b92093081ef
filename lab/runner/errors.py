"""What a run, a sweep or a tune stops on: their own module, so that the `lab` command can catch
it without importing the runner (and, through it, the analysis and scipy) for commands that only read."""

from __future__ import annotations


class RunError(RuntimeError):
    """The run cannot go on; one line a person can act on."""


class Interrupted(BaseException):
    """`lab run` was asked to stop (Ctrl-C or SIGTERM); the slot stays pending for --resume."""
