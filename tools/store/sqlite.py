"""SQLite backend: one file, WAL journal, writers serialised by `BEGIN IMMEDIATE` and a busy timeout.

WAL lets readers run beside the single writer; `BEGIN IMMEDIATE` takes the write lock before the
first read, so a booking's availability check and its update see the same rows (no lock upgrade,
no SQLITE_BUSY_SNAPSHOT). `synchronous=FULL`: a committed booking survives a power cut.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from datetime import date, datetime
from pathlib import Path
from typing import Any

from .base import Conflict, SchemaTooNew, Store, StoreError, Transient, migrations, statements


class SqliteStore(Store):
    dialect = "sqlite"

    def __init__(self, path: str | Path, *, pool_size: int = 8, busy_timeout_s: float = 10.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._busy_timeout_s = busy_timeout_s
        super().__init__(pool_size)
        self.migrate()

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r})"

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; we issue BEGIN/COMMIT ourselves.
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def _healthy(self, conn: sqlite3.Connection) -> bool:
        return not conn.in_transaction

    def _begin(self, conn: sqlite3.Connection, write: bool) -> None:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def _commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def _execute(self, conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> sqlite3.Cursor:
        return conn.execute(sql, params)

    def _execute_many(self, conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        conn.executemany(sql, rows)

    def _param(self, value: Any) -> Any:
        # Dates and times as ISO text (the stdlib's implicit adapters are deprecated).
        if isinstance(value, datetime | date):
            return value.isoformat()
        return value

    def _classify(self, exc: BaseException) -> type[StoreError] | None:
        if isinstance(exc, sqlite3.IntegrityError) and "UNIQUE" in str(exc):
            return Conflict
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower():
            return Transient
        return None

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
            )
            applied = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            known = migrations(self.dialect)
            if applied and max(applied) > len(known):
                raise SchemaTooNew(
                    f"{self.path} has schema version {max(applied)}; this code knows up to {len(known)}"
                )
            for version, name, sql in known:
                if version in applied:
                    continue
                for statement in statements(sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                    (version, name, self.now().isoformat()),
                )
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise
