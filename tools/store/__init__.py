"""The booking database: SQLite by default, PostgreSQL when `DATABASE_URL` is set; `open_store` opens (and
migrates) the one the settings name. The names callers use, gathered; no SQL of its own."""

from __future__ import annotations

from ..settings import StoreSettings
from .base import Store
from .errors import Conflict, Duplicate, SchemaTooNew, StoreError, Transient
from .records import FaqEntry, HotelPolicy, Night, Reservation, RoomType
from .schema import LATEST_VERSION
from .statements import Tx

__all__ = [
    "LATEST_VERSION",
    "Conflict",
    "Duplicate",
    "FaqEntry",
    "HotelPolicy",
    "Night",
    "Reservation",
    "RoomType",
    "SchemaTooNew",
    "Store",
    "StoreError",
    "Transient",
    "Tx",
    "open_store",
]


def open_store(settings: StoreSettings | None = None, *, migrate: bool = True) -> Store:
    """Open the store the settings (default: the environment) point at, and migrate it (the worker at start,
    the tools' commands). `migrate=False` (a room's process): the store must exist and be migrated already;
    it is checked, never changed, and refused with a StoreError otherwise."""
    settings = settings or StoreSettings.from_env()
    if settings.database_url:
        from .postgres import PostgresStore  # psycopg only when PostgreSQL is used

        return PostgresStore(
            settings.database_url,
            schema=settings.schema,
            pool_size=settings.pool_size,
            wait_s=settings.wait_s,
            migrate=migrate,
        )
    from .sqlite import SqliteStore

    return SqliteStore(
        settings.sqlite_path, pool_size=settings.pool_size, wait_s=settings.wait_s, migrate=migrate
    )
