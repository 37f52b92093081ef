"""Optuna's storage in the store's own database, so one file (or one PostgreSQL database) holds a
study's trials beside the boots that measured them."""

from __future__ import annotations

from typing import Any

import optuna
from sqlalchemy import event, inspect

from lab.store.db import Store, StoreError, scrubbed
from lab.store.reconnect import retry_connects


def study_storage(store: Store) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the store's URL; its tables are created once even when several hosts
    open an empty PostgreSQL database at the same moment."""
    if store.read_only:
        # A reader's connections refuse writes (lab.store.db); Optuna must not try to create its tables.
        return _storage(store, skip_table_creation=True, engine_kwargs={"connect_args": store.connect_args})
    if store.postgresql:
        with store.lock("optuna schema"):
            return _storage(store, engine_kwargs={"pool_pre_ping": True})
    # The lab writes to the same SQLite file between Optuna's writes: wait for its lock, not fail.
    return _storage(store, engine_kwargs={"connect_args": {"timeout": 30}})


def _storage(store: Store, **kwargs: Any) -> optuna.storages.RDBStorage:
    """The storage, failing as the store does: one line naming the store with its password masked."""
    try:
        storage = optuna.storages.RDBStorage(store.url, **kwargs)
    except StoreError:
        raise
    except Exception as exc:  # the server went away between the store's connection and Optuna's
        reason = scrubbed(f"{exc.__class__.__name__}: {exc}", store.url).splitlines()[0]
        raise StoreError(f"cannot open the Optuna study storage in {store.shown}: {reason}") from None
    if store.postgresql:
        event.listen(storage.engine, "handle_error", store.unreachable)
        retry_connects(storage.engine)  # a server restarted between trials is waited for
    return storage


def has_studies(store: Store) -> bool:
    """Whether Optuna's tables are in the store (a store only `lab run` wrote has none, and a reader
    may not create them)."""
    return inspect(store.engine).has_table("studies")
