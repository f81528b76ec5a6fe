"""PostgreSQL backend (psycopg 3): READ COMMITTED writers that lock the inventory rows they decide on.

A booking reads its nights with `SELECT ... FOR UPDATE` in (room type, night) order, so concurrent
writers of the same nights queue on row locks and each sees the previous one's commit; a unique key
taken by a concurrent writer, a deadlock or a serialization failure retries the transaction. Reads
run as REPEATABLE READ, READ ONLY snapshots. `schema` isolates a store inside one database (tests).
Connections come from a `psycopg_pool.ConnectionPool` (checked before use, so a connection the server dropped
is replaced rather than failing a call); a call that finds none free within `wait_s` gets `Busy`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..errors import Busy
from ..settings import SCHEMA_NAME
from .base import Conflict, SchemaTooNew, Store, StoreError, Transient, migrations, statements

log = logging.getLogger(__name__)

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
        wait_s: float = 5.0,
        lock_timeout_s: float = 10.0,
        connect_timeout_s: int = 10,
    ):
        if not SCHEMA_NAME.match(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        if pool_size < 1:
            raise ValueError("pool size must be at least 1")
        if not wait_s > 0:
            raise ValueError("the wait for a connection must be above 0 s")
        self.url = url
        self.schema = schema
        self._wait_s = wait_s
        connection: dict[str, Any] = {
            "autocommit": True,  # we issue BEGIN/COMMIT ourselves, as on SQLite
            "connect_timeout": connect_timeout_s,
            "options": f"-c search_path={schema} -c lock_timeout={int(lock_timeout_s * 1000)}",
            "application_name": "chorus-hotel",
        }
        # a wrong URL or a server that is down fails here at once, with psycopg's reason (the pool would
        # retry until connect_timeout_s and then say only that it timed out)
        psycopg.connect(url, **connection).close()
        # pool_size connections, opened at once and kept (each replaced after an hour); one handed back
        # inside a transaction is rolled back, a broken one is replaced
        self._pool = ConnectionPool(
            url,
            kwargs=connection,
            min_size=pool_size,
            check=ConnectionPool.check_connection,
            timeout=wait_s,
            name=f"chorus-hotel-{schema}",
            open=False,
        )
        try:
            try:
                self._pool.open(wait=True, timeout=connect_timeout_s)
            except PoolTimeout:
                raise StoreError(f"no connection to PostgreSQL within {connect_timeout_s} s") from None
            self.migrate()
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self.schema!r})"  # the URL may hold a password

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            conn = self._pool.getconn()
        except PoolTimeout:
            log.warning("store: no free PostgreSQL connection within %.1f s", self._wait_s)
            raise Busy() from None
        except PoolClosed:
            raise StoreError("the store is closed") from None
        try:
            yield conn
        finally:
            self._pool.putconn(conn)

    def close(self) -> None:
        self._pool.close()

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
        with self._connection() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))
