"""Optuna's storage in the store's own database, so one file (or one PostgreSQL database) holds a
study's trials beside the boots that measured them."""

from __future__ import annotations

import optuna

from lab.store.db import Store
from lab.store.reconnect import retry_connects


def study_storage(store: Store) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the store's URL; its tables are created once even when several hosts
    open an empty PostgreSQL database at the same moment."""
    if store.read_only:
        # A reader's connections refuse writes (lab.store.db); Optuna must not try to create its tables.
        return optuna.storages.RDBStorage(store.url, skip_table_creation=True,
                                          engine_kwargs={"connect_args": store.connect_args})
    if store.postgresql:
        with store.lock("optuna schema"):
            storage = optuna.storages.RDBStorage(store.url, engine_kwargs={"pool_pre_ping": True})
        retry_connects(storage.engine)  # a server restarted between trials is waited for
        return storage
    # The lab writes to the same SQLite file between Optuna's writes: wait for its lock, not fail.
    return optuna.storages.RDBStorage(store.url, engine_kwargs={"connect_args": {"timeout": 30}})
