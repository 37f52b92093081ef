"""What the store does when its database goes away or refuses a write.

A PostgreSQL server that restarts under a long `lab run` or `lab tune --worker` costs a wait, not
the run: a connection found dead is replaced (SQLAlchemy's pre-ping), a new connection is tried
again until the server is back (`retry_connects`), and a write whose transaction the restart cut
is run again as a whole (`writes`), each for up to RECONNECT_S. Only a server that answered once
is waited for: a store that was never reachable is refused at once. Two processes writing one
SQLite file take turns the same way. Every other failure to write (a full disk, a read-only file
or user) is a StoreError in one line, which the commands report and stop on; nothing
half-written is left, because each write is one transaction.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

from sqlalchemy import Engine, event
from sqlalchemy.exc import DBAPIError, IntegrityError

from lab.store.db import Store, StoreDropped, StoreError, scrubbed

log = logging.getLogger("lab.store")
# How long a server that answered before is waited for: a restart takes seconds; a server gone for
# longer ends the command in one line (lab.store.db.Store.unreachable), and it resumes later.
RECONNECT_S = 30.0
F = TypeVar("F", bound=Callable[..., Any])


def writes(fn: F) -> F:
    """A writer function (its first argument the Store) that is one transaction: run again whole when
    a PostgreSQL restart cut it, and any other database failure raised as a one-line StoreError."""
    @functools.wraps(fn)
    def wrapper(store: Store, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + RECONNECT_S
        pause = 0.2
        while True:
            try:
                return fn(store, *args, **kwargs)
            except IntegrityError:
                raise  # a second copy of a unique row: the caller's to judge
            except StoreDropped as exc:  # the server restarted under the write: its transaction was rolled back
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("%s; writing again", exc)
            except DBAPIError as exc:
                if not _transient(store, exc) or time.monotonic() + pause > deadline:
                    raise StoreError(f"cannot write the store {store.shown}: {scrubbed(_one_line(exc), store.url)}") \
                        from exc
                log.warning("the store did not take a write (%s); writing again", _one_line(exc))
            time.sleep(pause)
            pause = min(2 * pause, 5.0)
    return wrapper  # type: ignore[return-value]


def retry_connects(engine: Engine) -> None:
    """New connections of `engine` are tried again for up to RECONNECT_S while the server refuses
    them, once one has succeeded: a server that answered before is restarting, not misnamed."""
    answered = [False]

    @event.listens_for(engine, "do_connect")
    def connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        deadline = time.monotonic() + RECONNECT_S
        pause = 0.2
        while True:
            try:
                connection = dialect.loaded_dbapi.connect(*cargs, **cparams)
                answered[0] = True
                return connection
            except dialect.loaded_dbapi.OperationalError as exc:
                if not answered[0] or time.monotonic() + pause > deadline:
                    answered[0] = False  # given up on: the cleanup that follows does not wait again
                    raise
                log.warning("the store's server does not answer (%s); trying again", _one_line(exc))
                time.sleep(pause)
                pause = min(2 * pause, 5.0)


def _transient(store: Store, exc: DBAPIError) -> bool:
    """A failure that writing again, whole, gets past: SQLite's "database is locked", which it
    answers at once, without waiting out its busy timeout, when a transaction that read must become
    a writer after another process wrote (PostgreSQL's dropped connections are StoreDropped)."""
    return not store.postgresql and "database is locked" in str(exc)


def _one_line(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    text = " ".join(str(inner).split())
    return f"{type(inner).__name__}: {text}"[:300]
