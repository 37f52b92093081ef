"""Opening a store: a SQLite file by default (WAL, foreign keys on), or PostgreSQL for a store shared
by several hosts (`postgresql://user:password@host/db`, through psycopg 3). Any other scheme is refused
in one line that names these two.

A store URL is shown only through `shown(target)`, with its password masked (`***`): in errors, logs
and what the lab prints or stores, so no password reaches cron mail, CI logs or the database.

The commands that only read (`lab ls`, `report`, `compare`, `export`, `history`, `serve`) open it
read-only: nothing is created or upgraded, a SQLite file is opened in SQLite's read-only mode and a
PostgreSQL session is a read-only transaction, so the database itself refuses any write. A store on
a read-only path, one a database user may only read, or one another process is writing all work.

A SQLite file compressed with xz (`X.db.xz`, as the stores in results/ are kept) is read where it
lies: it is decompressed once into a cache directory and opened read-only there. The commands that
add runs refuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import lzma
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from sqlalchemy import URL, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from lab.store.models import Base, Meta

SCHEMA_VERSION = "1"
T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used; the message says why in one line."""


class StoreDropped(StoreError):
    """The database server dropped a connection in use (restarted, unplugged): a write it cut is
    written again once the server answers (lab/store/reconnect.py), within its patience."""


SCHEMES = ("sqlite", "postgresql")  # the backends the lab's tables and locks are written for


def shown(target: str) -> str:
    """A store as the lab prints it: a path as given, a URL with its password masked."""
    if "://" not in target:
        return target
    try:
        return make_url(target).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: mask whatever sits between user: and @
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", target)


def scrubbed(message: str, target: str) -> str:
    """`message` (a driver's error, say) with the target's password replaced by ***, wherever it appears."""
    password = _password(target)
    if password:
        message = message.replace(password, "***").replace(quote(password, safe=""), "***")
    return message


def _password(target: str) -> str | None:
    if "://" not in target:
        return None
    try:
        return make_url(target).password
    except Exception:
        found = re.search(r"://[^:/@]*:([^@]*)@", target)
        return found.group(1) if found else None


class Store:
    def __init__(self, url: str, read_only: bool = False, target: str | None = None) -> None:
        self.url = url  # with its password: the database driver (and Optuna's storage) connect with it
        self.shown = shown(target or url)  # as the user gave it, password masked
        self.read_only = read_only
        backend = make_url(url).get_backend_name()
        # A read-only PostgreSQL session: the server refuses any write, whatever the user may do.
        self.connect_args: dict[str, Any] = ({"options": "-c default_transaction_read_only=on"}
                                             if read_only and backend == "postgresql" else {})
        # pool_pre_ping: a connection a restarted PostgreSQL server dropped is replaced, not used.
        self.engine: Engine = create_engine(url, connect_args=self.connect_args,
                                            pool_pre_ping=backend == "postgresql")
        if backend == "postgresql":
            from lab.store.reconnect import retry_connects  # it imports this module

            retry_connects(self.engine)
        if backend == "sqlite":
            event.listen(self.engine, "connect", functools.partial(_sqlite_pragmas, wal=not read_only))
        else:
            event.listen(self.engine, "handle_error", self.unreachable)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._sessions()

    def unreachable(self, context: ExceptionContext) -> None:
        """A database server that refuses the connection or drops it (stopped, unplugged, a wrong
        password) ends the command with one line naming the store without its password, not with a
        driver's traceback."""
        if context.is_pre_ping:
            return  # a pooled connection found dead before use: the pool replaces it
        reason = scrubbed(f"{context.original_exception.__class__.__name__}: {context.original_exception}",
                          self.url).splitlines()[0]
        if context.connection is None:  # no connection could be made
            raise StoreError(f"cannot open store {self.shown}: {reason}")
        if context.is_disconnect:
            raise StoreDropped(f"the store {self.shown} dropped the connection: {reason}")

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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, wal: bool = True) -> None:
    cursor = dbapi_connection.cursor()
    # First, so that switching to WAL waits for another process's lock instead of failing at once.
    cursor.execute("PRAGMA busy_timeout=30000")
    if wal:
        # WAL: `lab ls` can read while `lab run` writes, and a killed writer loses no committed step.
        # A reader leaves the mode as the file has it: setting it is a write.
        cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def resolve_url(target: str) -> str:
    """`lab.db` or `/x/y.db` -> a sqlite URL; `postgresql://` (or `postgres://`) -> psycopg 3, the
    driver the lab installs; a `sqlite://` or `postgresql+DRIVER://` URL as it is; any other scheme
    is refused (StoreError)."""
    for scheme in ("postgresql://", "postgres://"):
        if target.startswith(scheme):
            return "postgresql+psycopg://" + target[len(scheme):]
    if "://" not in target:
        return f"sqlite:///{Path(target).expanduser().resolve()}"
    scheme = target.split("://", 1)[0]
    if scheme.split("+", 1)[0].lower() not in SCHEMES:
        raise StoreError(f"unsupported store URL scheme {scheme}:// in {shown(target)}; the lab stores its runs in "
                         "SQLite (a file path, or sqlite:///PATH) or PostgreSQL (postgresql://user:password@host/db)")
    return target


def _cannot_open(target: str, exc: Exception) -> StoreError:
    """One line: which store (password masked) and the first line of the driver's reason, scrubbed."""
    reason = scrubbed(f"{exc.__class__.__name__}: {exc}".splitlines()[0], target)
    return StoreError(f"cannot open store {shown(target)}: {reason}")


def open_store(target: str, read_only: bool = False) -> Store:
    """The store at `target`, created (tables, added columns) where missing; with `read_only`, an
    existing store opened for reading only (module docstring), or StoreError saying why it cannot be."""
    if target.endswith(".xz") and "://" not in target:
        if not read_only:
            raise StoreError(f"{target} is a compressed store, which lab only reads; to write to it, decompress it "
                             f"(xz -dk {target}) and pass --db {target[:-len('.xz')]}")
        path = Path(target).expanduser()
        if not path.is_file():
            raise StoreError(f"no store at {target}; pass --db with the file `lab run` wrote")
        target = str(_decompressed(path))
    url = resolve_url(target)
    if read_only:
        return _open_read_only(target, url)
    try:
        store = Store(url, target=target)
    except Exception as exc:  # a URL SQLAlchemy cannot parse, a driver that is not installed
        raise _cannot_open(target, exc) from None
    try:
        if store.postgresql:
            # Hosts starting at once on an empty database take turns at creating the tables.
            with store.lock("lab schema"):
                _create_tables(store)
        else:
            _create_tables(store)
        version = _retry(lambda: _schema_version(store), (LOCKED,))
        if version != SCHEMA_VERSION:
            raise StoreError(f"{shown(target)} has store schema {version}; this lab writes schema {SCHEMA_VERSION}")
    except StoreError:
        store.close()
        raise
    except Exception as exc:  # a bad URL, a missing driver, a locked or foreign file
        store.close()
        raise _cannot_open(target, exc) from None
    return store


def _open_read_only(target: str, url: str) -> Store:
    path = Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
    if path is not None and not path.exists():
        raise StoreError(f"no store at {target}; pass --db with the file `lab run` wrote")
    try:
        store = _sqlite_read_only(path) if path is not None else Store(url, read_only=True, target=target)
    except Exception as exc:  # a bad URL, a missing driver, no permission to read
        raise _cannot_open(target, exc) from None
    store.shown = shown(target)  # the file as given, not the read-only URI it is opened through
    try:
        _check_read_only_schema(store, shown(target))
    except StoreError:
        store.close()
        raise
    except Exception as exc:  # a foreign file, a database that refuses us
        store.close()
        raise _cannot_open(target, exc) from None
    return store


def _sqlite_read_only(path: Path) -> Store:
    """A SQLite file in SQLite's read-only mode. A WAL store needs its `-shm` index beside it, which
    a reader creates when it is missing; where it is missing and cannot be created (a read-only
    directory) no process is writing the store in WAL mode, and it is opened as immutable."""
    try:
        return _sqlite_opened(path, immutable=False)
    except OperationalError as exc:
        if "unable to open database file" not in str(exc):
            raise
    return _sqlite_opened(path, immutable=True)


def _sqlite_opened(path: Path, immutable: bool) -> Store:
    query = {"mode": "ro", "uri": "true", **({"immutable": "1"} if immutable else {})}
    url = URL.create("sqlite", database=f"file:{quote(str(path))}", query=query)
    store = Store(url.render_as_string(hide_password=False), read_only=True)
    try:
        with store.engine.connect() as connection:
            connection.execute(text("SELECT count(*) FROM sqlite_master"))
    except OperationalError:
        store.close()
        raise
    return store


def _check_read_only_schema(store: Store, target: str) -> None:
    """Refuse a store this lab cannot read as it is: another schema version, or tables or columns an
    earlier lab did not create (a writing command adds them in place; a reader may not)."""
    existing = inspect(store.engine)
    tables = set(existing.get_table_names())
    if not tables & {table.name for table in Base.metadata.sorted_tables}:
        raise StoreError(f"no lab store in {target} (it holds none of the lab's tables); `lab run --db` with it "
                         "creates one")
    for table in Base.metadata.sorted_tables:
        missing = [table.name] if table.name not in tables else \
            [f"{table.name}.{c.name}" for c in table.columns
             if c.name not in {col["name"] for col in existing.get_columns(table.name)}]
        if missing:
            raise StoreError(f"{target} was written by an earlier lab and lacks {missing[0]}; a command that "
                             "writes (`lab run`, `lab calibrate`) adds it, a reading one opens the store as it is")
    with store.session() as session:
        row = session.get(Meta, "schema_version")
    version = row.value if row is not None else None
    if version != SCHEMA_VERSION:
        raise StoreError(f"{target} has store schema {version}; this lab reads schema {SCHEMA_VERSION}")


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
    """Bring the decompressed copy to this lab's tables (a store written by an earlier lab may lack a
    column), then out of WAL mode, so a reader needs no `-shm` file beside it."""
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
