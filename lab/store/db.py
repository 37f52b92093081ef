"""Opening a store: a SQLite file by default (WAL, foreign keys on), PostgreSQL for a store shared by
several hosts (`postgresql://user@host/db`, through psycopg 3), any SQLAlchemy URL otherwise.

A SQLite file compressed with xz (`X.db.xz`, as the stores in results/ are kept) is read where it
lies: it is decompressed once into a cache directory, and each command reads that copy into memory, so
nothing it writes (`lab report` stores the verdicts it judges again) reaches a file. The commands that
add runs refuse it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import lzma
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from lab.store.models import Base, Meta

SCHEMA_VERSION = "1"
T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used; the message says why in one line."""


class Store:
    def __init__(self, url: str, engine: Engine | None = None) -> None:
        self.url = url
        self.engine: Engine = engine if engine is not None else create_engine(url)
        if engine is None and self.engine.dialect.name == "sqlite":
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
    """The store at `target`; `create=False` for commands that only read (they may also read an
    xz-compressed SQLite file), which then refuse a store that is not there."""
    if target.endswith(".xz") and "://" not in target:
        if create:
            raise StoreError(f"{target} is a compressed store, which lab only reads; to write to it, decompress it "
                             f"(xz -dk {target}) and pass --db {target[:-len('.xz')]}")
        return _open_compressed(Path(target).expanduser())
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


def cache_dir() -> Path:
    """Where compressed stores are decompressed: $XDG_CACHE_HOME/lab/stores, else ~/.cache/lab/stores."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lab" / "stores"


def _open_compressed(path: Path) -> Store:
    if not path.is_file():
        raise StoreError(f"no store at {path}; pass --db with the file `lab run` wrote")
    cached = _decompressed(path)

    def connect() -> sqlite3.Connection:
        connection = sqlite3.connect(":memory:", check_same_thread=False)
        connection.deserialize(cached.read_bytes())
        connection.execute("PRAGMA foreign_keys=ON")
        return connection

    # One connection for the command's whole life: each new one would be a fresh copy.
    return Store(f"sqlite:///{cached}", create_engine("sqlite://", creator=connect, poolclass=StaticPool))


def _decompressed(path: Path) -> Path:
    """The store decompressed into the cache, once per content and per table layout of this lab: named
    by the sha256 of the compressed file and of the tables' columns, so a lab that added a column
    decompresses it again and adds the column to its own copy before reading it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    columns = sorted(f"{t.name}.{c.name}" for t in Base.metadata.sorted_tables for c in t.columns)
    layout = hashlib.sha256("\n".join(columns).encode()).hexdigest()[:12]
    cached = cache_dir() / f"{digest.hexdigest()}-{layout}.db"
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=cached.parent, prefix=cached.stem, suffix=".part")
    partial = Path(name)
    try:
        with os.fdopen(handle, "wb") as out, lzma.open(path) as compressed:
            shutil.copyfileobj(compressed, out, 1 << 20)
        _prepare_copy(partial, path)
        os.replace(partial, cached)  # atomic: a reader in another process sees the whole copy or none
    except (lzma.LZMAError, EOFError) as exc:  # EOFError: the file ends before its stream does
        raise StoreError(f"cannot decompress {path}: {exc}") from None
    finally:
        for leftover in (partial, *(partial.with_name(partial.name + s) for s in ("-wal", "-shm", ".lock"))):
            leftover.unlink(missing_ok=True)
    return cached


def _prepare_copy(copy: Path, source: Path) -> None:
    """Bring the decompressed copy to this lab's tables, then out of WAL mode: SQLite reads a database
    into memory only from a file in rollback-journal mode."""
    store = Store(f"sqlite:///{copy}")
    try:
        _create_tables(store)
        version = _schema_version(store)
        if version != SCHEMA_VERSION:
            raise StoreError(f"{source} has store schema {version}; this lab reads schema {SCHEMA_VERSION}")
        with store.engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA journal_mode=DELETE")
    except StoreError:
        raise
    except Exception as exc:  # not a SQLite file, or not a lab store
        raise StoreError(f"cannot read store {source}: {exc.__class__.__name__}: {exc}".splitlines()[0]) from None
    finally:
        store.close()
