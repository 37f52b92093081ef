"""Opening a store: a SQLite file by default (WAL, foreign keys on), PostgreSQL for a store shared by
several hosts (`postgresql://user@host/db`, through psycopg 3), any SQLAlchemy URL otherwise."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from lab.store.models import Base, Meta

SCHEMA_VERSION = "1"
T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used; the message says why in one line."""


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = create_engine(url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._sessions()

    def close(self) -> None:
        self.engine.dispose()

    @property
    def postgresql(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Held by one process at a time among all those using this store, on any host: a
        PostgreSQL advisory lock, or for a SQLite file a lock file beside it (SQLite is one host)."""
        if self.postgresql:
            key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
            with self.engine.connect() as connection:
                # A session-level lock: held across the caller's own transactions, on other connections.
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
                try:
                    yield
                finally:
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
            return
        if not self.url.startswith("sqlite:///"):
            raise StoreError(f"{self.engine.dialect.name} stores cannot be shared by several lab processes; "
                             "use PostgreSQL or a SQLite file")
        with open(self.url[len("sqlite:///"):] + ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # First, so that switching to WAL waits for another process's lock instead of failing at once.
    cursor.execute("PRAGMA busy_timeout=30000")
    # WAL: `lab ls` can read while `lab run` writes, and a killed writer loses no committed step.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def resolve_url(target: str) -> str:
    """`lab.db` or `/x/y.db` -> a sqlite URL; `postgresql://` (or `postgres://`) -> psycopg 3, the
    driver the lab installs; anything else with `://` is taken as a SQLAlchemy URL."""
    for scheme in ("postgresql://", "postgres://"):
        if target.startswith(scheme):
            return "postgresql+psycopg://" + target[len(scheme):]
    if "://" in target:
        return target
    return f"sqlite:///{Path(target).expanduser().resolve()}"


def open_store(target: str, create: bool = True) -> Store:
    url = resolve_url(target)
    if url.startswith("sqlite:///") and not create and not Path(url[len("sqlite:///"):]).exists():
        raise StoreError(f"no store at {target}; pass --db with the file `lab run` wrote")
    store = Store(url)
    try:
        if store.postgresql:
            # Hosts starting at once on an empty database take turns at creating the tables.
            with store.lock("lab schema"):
                _create_tables(store)
        else:
            _create_tables(store)
        version = _retry(lambda: _schema_version(store), (LOCKED,))
        if version != SCHEMA_VERSION:
            raise StoreError(f"{target} has store schema {version}; this lab writes schema {SCHEMA_VERSION}")
    except StoreError:
        store.close()
        raise
    except Exception as exc:  # a bad URL, a missing driver, a locked or foreign file
        store.close()
        raise StoreError(f"cannot open store {target}: {exc.__class__.__name__}: {exc}".splitlines()[0]) from None
    return store


def _schema_version(store: Store) -> str:
    """The store's schema version, recorded as ours when the store is new."""
    try:
        with store.session() as session, session.begin():
            row = session.get(Meta, "schema_version")
            if row is not None:
                return row.value
            session.add(Meta(key="schema_version", value=SCHEMA_VERSION))
            return SCHEMA_VERSION
    except IntegrityError:  # another process recorded it first
        with store.session() as session:
            return session.get_one(Meta, "schema_version").value


def _create_tables(store: Store) -> None:
    """Create missing tables; another process creating them at the same moment is not an error.
    SQLite commits each CREATE TABLE on its own, so a creator that lost a race waits a little
    for the other to finish its schema before looking again (retrying at once loses again)."""
    def create() -> None:
        Base.metadata.create_all(store.engine)
        _add_new_columns(store)

    _retry(create, ("already exists", "duplicate column", LOCKED))


# SQLite answers this at once, without waiting out busy_timeout, when a transaction that read
# must become a writer while another connection writes (waiting could deadlock): new stores
# opened by several processes at once meet it. Trying the transaction again a moment later works.
LOCKED = "database is locked"


def _retry(fn: Callable[[], T], transient: tuple[str, ...], attempts: int = 8) -> T:
    """fn(), tried again after a growing pause while it fails with an OperationalError whose
    message holds one of `transient` (another process's schema work in flight)."""
    for attempt in range(attempts - 1):
        try:
            return fn()
        except OperationalError as exc:
            if not any(text_ in str(exc) for text_ in transient):
                raise
            time.sleep(0.05 * (attempt + 1))
    return fn()


def _add_new_columns(store: Store) -> None:
    """Nullable columns added to a table since a store was created (run.reason): added in place,
    so a store written by an earlier lab stays readable and writable, and that lab can still read it."""
    existing = inspect(store.engine)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in existing.get_columns(table.name)}
        for column in table.columns:
            if column.name in have or not column.nullable:
                continue
            kind = column.type.compile(dialect=store.engine.dialect)
            with store.engine.begin() as connection:
                connection.execute(text(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}'))
