"""PostgreSQL backend (psycopg 3): READ COMMITTED writers that lock the inventory rows they decide on.

A booking reads its nights with `SELECT ... FOR UPDATE` in (room type, night) order, so concurrent
writers of the same nights queue on row locks and each sees the previous one's commit; a unique key
taken by a concurrent writer, a deadlock or a serialization failure retries the transaction. Reads
run as REPEATABLE READ, READ ONLY snapshots. `schema` isolates a store inside one database (tests).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.pq import TransactionStatus

from .base import Conflict, SchemaTooNew, Store, StoreError, Transient, migrations, statements

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_MIGRATION_LOCK = 0x43484F52  # "CHOR": serialises concurrent migrators of one database


class PostgresStore(Store):
    dialect = "postgres"
    lock_clause = " FOR UPDATE"

    def __init__(
        self,
        url: str,
        *,
        schema: str = "public",
        pool_size: int = 8,
        lock_timeout_s: float = 10.0,
        connect_timeout_s: int = 10,
    ):
        if not _IDENT.match(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        self.url = url
        self.schema = schema
        self._lock_timeout_ms = int(lock_timeout_s * 1000)
        self._connect_timeout_s = connect_timeout_s
        super().__init__(pool_size)
        self.migrate()

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self.schema!r})"  # the URL may hold a password

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.url,
            autocommit=True,  # we issue BEGIN/COMMIT ourselves, as on SQLite
            connect_timeout=self._connect_timeout_s,
            options=f"-c search_path={self.schema} -c lock_timeout={self._lock_timeout_ms}",
            application_name="chorus-hotel",
        )
        return conn

    def _healthy(self, conn: psycopg.Connection[Any]) -> bool:
        return not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE

    def _begin(self, conn: psycopg.Connection[Any], write: bool) -> None:
        conn.execute("BEGIN" if write else "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")

    def _commit(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: psycopg.Connection[Any]) -> None:
        if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error:
            conn.close()  # the pool drops it

    def _execute(self, conn: psycopg.Connection[Any], query: str, params: Sequence[Any]) -> Any:
        # Our statements use `?`; none contains a literal `?` or `%`.
        return conn.execute(query.replace("?", "%s"), params)  # type: ignore[arg-type]

    def _execute_many(self, conn: psycopg.Connection[Any], query: str, rows: Sequence[Sequence[Any]]) -> None:
        with conn.cursor() as cur:
            cur.executemany(query.replace("?", "%s"), rows)  # type: ignore[arg-type]

    def _classify(self, exc: BaseException) -> type[StoreError] | None:
        if isinstance(exc, errors.UniqueViolation):
            return Conflict
        if isinstance(exc, errors.SerializationFailure | errors.DeadlockDetected | errors.LockNotAvailable):
            return Transient
        return None

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        # A concurrent migrator may create the schema between the check and the insert.
        with contextlib.suppress(errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK, self.schema))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL)"
            )
            applied = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            known = migrations(self.dialect)
            if applied and max(applied) > len(known):
                raise SchemaTooNew(
                    f"schema {self.schema!r} has version {max(applied)}; this code knows up to {len(known)}"
                )
            for version, name, text in known:
                if version in applied:
                    continue
                for statement in statements(text):
                    conn.execute(statement)  # type: ignore[arg-type]
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (%s, %s, %s)",
                    (version, name, self.now()),
                )

    def drop_schema(self) -> None:
        """Delete this store's schema and everything in it (the tests' clean slate)."""
        with self._pool.connection() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))
