"""Opening a store: a SQLite file by default (WAL, foreign keys on), any SQLAlchemy URL otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session, sessionmaker

from lab.store.models import Base, Meta

SCHEMA_VERSION = "1"


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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL: `lab ls` can read while `lab run` writes, and a killed writer loses no committed step.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def resolve_url(target: str) -> str:
    """`lab.db` or `/x/y.db` -> a sqlite URL; anything with `://` is taken as a SQLAlchemy URL."""
    if "://" in target:
        return target
    return f"sqlite:///{Path(target).expanduser().resolve()}"


def open_store(target: str, create: bool = True) -> Store:
    url = resolve_url(target)
    if url.startswith("sqlite:///") and not create and not Path(url[len("sqlite:///"):]).exists():
        raise StoreError(f"no store at {target}; pass --db with the file `lab run` wrote")
    store = Store(url)
    try:
        Base.metadata.create_all(store.engine)
        with store.session() as session, session.begin():
            row = session.get(Meta, "schema_version")
            if row is None:
                session.add(Meta(key="schema_version", value=SCHEMA_VERSION))
            elif row.value != SCHEMA_VERSION:
                raise StoreError(f"{target} has store schema {row.value}; this lab writes schema {SCHEMA_VERSION}")
    except StoreError:
        store.close()
        raise
    except Exception as exc:  # a bad URL, a missing driver, a locked or foreign file
        store.close()
        raise StoreError(f"cannot open store {target}: {exc.__class__.__name__}: {exc}".splitlines()[0]) from None
    return store


def schema_version(store: Store) -> str | None:
    with store.session() as session:
        return session.scalar(select(Meta.value).where(Meta.key == "schema_version"))
