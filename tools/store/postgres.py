"""PostgreSQL backend (psycopg 3, PostgreSQL 14 or later): READ COMMITTED writers that lock the inventory
rows they decide on, pooled connections checked before use, every wait cut at the call's deadline, and each
error read by its SQLSTATE. Knows psycopg, the server's timeouts and what its errors mean for a transaction;
not the statements it runs (statements.py) or the retries (base.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.abc import PQGen
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..errors import Busy
from ..settings import SCHEMA_NAME
from .base import Store
from .errors import Conflict, Lost, StoreError, Transient, Unavailable
from .schema import apply_migrations

log = logging.getLogger(__name__)

_MIGRATION_LOCK = 0x43484F52  # "CHOR": serialises concurrent migrators of one database

# The server ends a statement this long before the client would cut the connection, so a server that is
# alive but slow answers with a clean error (the transaction rolled back, the connection kept).
_SERVER_FIRST_S = 0.25
# What psycopg's `Connection.wait` raises when its timeout runs out (its `_WaitTimeout`, an OperationalError)
_WAIT_TIMEOUT: type[Exception] = getattr(errors, "_WaitTimeout", psycopg.OperationalError)

# What an error the server sent means for the transaction, by its SQLSTATE (the manual's Appendix A): the
# full code first, then its two-character class; a code in neither is a statement refused (a bug).
_BY_CODE: dict[str, type[StoreError]] = {
    "23505": Conflict,  # unique_violation: a concurrent writer took the key first (again: a duplicate)
    "40001": Transient,  # serialization_failure
    "40P01": Transient,  # deadlock_detected
    "55P03": Transient,  # lock_not_available: `lock_timeout` ran out
    "72000": Transient,  # snapshot_too_old
    "40002": StoreError,  # transaction_integrity_constraint_violation: a constraint checked at COMMIT
    "57014": Unavailable,  # query_canceled: `statement_timeout` (the call's deadline) or a cancel
    "57P01": Lost,  # admin_shutdown: the server is shutting down, or ended this backend
    "57P02": Lost,  # crash_shutdown: another backend crashed and the server is restarting
    "57P03": Lost,  # cannot_connect_now: the server is starting up or shutting down
    "57P04": Lost,  # database_dropped
    "57P05": Lost,  # idle_session_timeout
    "25P03": Lost,  # idle_in_transaction_session_timeout: the session was ended
}
_BY_CLASS: dict[str, type[StoreError]] = {
    "08": Lost,  # connection exception
    "40": Transient,  # transaction rollback
    "53": Unavailable,  # insufficient resources: disk full, out of memory, too many connections
    "57": Unavailable,  # operator intervention
    "58": Unavailable,  # system error: an I/O error on the server
}
# What a refused statement asked for, by class, in the StoreError's message. The server's own message is
# never quoted: it can hold the statement's values (a guest's name in a unique key, the text of a bad cast).
_REFUSED: dict[str, str] = {
    "22": "a value its column's type cannot hold (a bad cast, a number out of range, text too long)",
    "23": "a row that breaks a constraint of its table",
    "25": "a statement the state of the transaction does not allow",
    "42": "a statement it cannot run (a syntax error, an unknown table or column, a missing permission)",
    "54": "a statement past one of the server's limits",
    "0A": "a feature the server does not support",
    "XX": "a statement that failed with an internal error of the server",
}


class DeadlineConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait on the server ends by `deadline` (a time.monotonic() value;
    None: no limit). A wait cut short leaves the protocol mid-exchange, so the connection is closed
    (the pool replaces it) and the statement raises `psycopg.OperationalError`. The server then reads
    end-of-file after whatever it was sent: a transaction whose COMMIT it never read rolls back."""

    deadline: float | None = None

    def wait(self, gen: PQGen[Any], interval: float = 0.1, timeout: float | None = None) -> Any:
        if self.deadline is None:
            return super().wait(gen, interval, timeout)
        left = max(0.0, self.deadline - time.monotonic())
        try:
            return super().wait(gen, interval, left if timeout is None else min(timeout, left))
        except _WAIT_TIMEOUT:
            if self.closed or (timeout is not None and timeout < left):
                raise  # the caller's own, shorter timeout
            self.pgconn.finish()
            raise psycopg.OperationalError("no answer from PostgreSQL by the call's deadline") from None


class PostgresStore(Store):
    """A booking reads its nights with `SELECT ... FOR UPDATE` in (room type, night) order, so concurrent
    writers of the same nights queue on row locks and each sees the previous one's commit; a unique key
    taken by a concurrent writer, a deadlock or a serialization failure retries the transaction. Reads
    run as REPEATABLE READ, READ ONLY snapshots. `schema` isolates a store inside one database (tests).
    Connections come from a `psycopg_pool.ConnectionPool` and are checked before use, so a connection the
    server dropped is replaced rather than failing a call; a call that finds none free within `wait_s` gets
    `Busy`.

    A transaction with a deadline sets its own `statement_timeout` and `lock_timeout`, and the client cuts
    the connection at the deadline even when the server answers nothing at all (a stopped server still
    accepts bytes into its socket, so neither TCP keepalives nor the server's own timeouts end that wait).
    Each write transaction learns its transaction id at BEGIN, so a COMMIT whose answer was lost is settled
    with `pg_xact_status` on another connection."""

    dialect = "postgres"
    lock_clause = " FOR UPDATE"
    migrations_table = (
        "SELECT COUNT(*) FROM information_schema.tables "
        "WHERE table_schema = current_schema() AND table_name = 'schema_migrations'"
    )

    def __init__(
        self,
        url: str,
        *,
        schema: str = "public",
        pool_size: int = 8,
        wait_s: float = 5.0,
        lock_timeout_s: float = 2.0,
        connect_timeout_s: int = 3,
        idle_in_transaction_s: float = 15.0,
        migrate: bool = True,
    ):
        """`lock_timeout_s`: a row lock waited on longer than this fails the attempt, which is retried
        (the call's deadline may cut it shorter). `connect_timeout_s`: opening one connection (libpq counts
        whole seconds, at least 2). `idle_in_transaction_s`: the server ends a session whose client left a
        transaction open and silent this long (a stopped client process), releasing its row locks.
        `migrate`: bring the schema up to date (the worker at start, the tools' commands); without it (a
        room's process) a schema not at this code's version is refused with a StoreError."""
        super().__init__()
        if not SCHEMA_NAME.match(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        if pool_size < 1:
            raise ValueError("pool size must be at least 1")
        if not wait_s > 0:
            raise ValueError("the wait for a connection must be above 0 s")
        self.url = url
        self.schema = schema
        self._wait_s = wait_s
        self._pool_size = pool_size
        self._lock_ms = int(lock_timeout_s * 1000)
        server = {
            "search_path": schema,
            "lock_timeout": self._lock_ms,  # a transaction with a deadline sets its own, no longer
            "idle_in_transaction_session_timeout": int(idle_in_transaction_s * 1000),
            # a backend whose client has gone stops the statement it is running within a second
            "client_connection_check_interval": 1000,
        }
        connection: dict[str, Any] = {
            "autocommit": True,  # we issue BEGIN/COMMIT ourselves, as on SQLite
            "connect_timeout": connect_timeout_s,
            "options": " ".join(f"-c {name}={value}" for name, value in server.items()),
            "application_name": "chorus-hotel",
            # A peer that vanished (host down, network cut) is found by the kernel: an idle connection
            # after 4 s of silence and two unanswered probes 2 s apart (8 s), one with data unacknowledged
            # after 8 s. These bound the pool's idle connections and calls without a deadline (seeding,
            # migrations); a call's own deadline is shorter.
            "keepalives": 1,
            "keepalives_idle": 4,
            "keepalives_interval": 2,
            "keepalives_count": 2,
            "tcp_user_timeout": 8000,
        }
        # a wrong URL or a server that is down fails here at once, with psycopg's reason (the pool would
        # retry until connect_timeout_s and then say only that it timed out)
        psycopg.connect(url, **connection).close()
        # pool_size connections, opened at once and kept (each replaced after an hour); one handed back
        # inside a transaction is rolled back, a broken one is replaced
        self._pool = ConnectionPool(
            url,
            kwargs=connection,
            connection_class=DeadlineConnection,
            min_size=pool_size,
            timeout=wait_s,
            name=f"chorus-hotel-{schema}",
            open=False,
        )
        open_s = 10.0  # the whole pool, at start
        try:
            try:
                self._pool.open(wait=True, timeout=open_s)
            except PoolTimeout:
                raise StoreError(f"no connection to PostgreSQL within {open_s:g} s") from None
            self.migrate() if migrate else self.check_schema()
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self.schema!r})"  # the URL may hold a password

    @contextmanager
    def _connection(self, deadline: float | None = None) -> Iterator[DeadlineConnection]:
        conn = self._checked(deadline)
        try:
            yield conn
        finally:
            conn.deadline = None
            self._pool.putconn(conn)

    def _checked(self, deadline: float | None) -> DeadlineConnection:
        """A pooled connection that answered an empty query by `deadline`. One that does not (the server
        dropped it, or restarted since) is handed back, to be replaced, and another is taken."""
        for _ in range(self._pool_size + 1):  # every pooled one may be dead after a restart
            wait = self._wait_s if deadline is None else min(self._wait_s, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                conn = self._pool.getconn(timeout=wait)
            except PoolTimeout:
                log.warning("store: no free PostgreSQL connection within %.1f s", wait)
                raise Busy() from None
            except PoolClosed:
                raise StoreError("the store is closed") from None
            conn.deadline = deadline
            try:
                conn.execute("")
                return conn
            except psycopg.Error:
                conn.deadline = None
                conn.close()
                self._pool.putconn(conn)
        log.warning("store: no working PostgreSQL connection by the call's deadline")
        raise Busy()

    def close(self) -> None:
        self._pool.close()

    def _begin(self, conn: psycopg.Connection[Any], write: bool, deadline: float | None) -> str | None:
        """BEGIN, with the transaction's timeouts when it has a deadline and, for a writer, its transaction
        id (the token `_settle` takes), in one round trip."""
        begin = "BEGIN" if write else "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        settings = ["pg_current_xact_id()::text"] if write else []
        if deadline is not None:
            ms = max(1, int((deadline - time.monotonic() - _SERVER_FIRST_S) * 1000))
            settings += [
                f"set_config('statement_timeout', '{ms}', true)",
                f"set_config('lock_timeout', '{min(ms, self._lock_ms)}', true)",
            ]
        if not settings:
            conn.execute(begin)
            return None
        cur = conn.execute(f"{begin}; SELECT {', '.join(settings)}")  # type: ignore[arg-type]
        cur.nextset()
        row = cur.fetchone()
        return row[0] if write and row else None

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

    def _classify(self, exc: BaseException, conn: psycopg.Connection[Any]) -> type[StoreError] | None:
        """By the error's SQLSTATE, as PostgreSQL's own clients do. An error without one was raised by psycopg
        itself: a connection it closed or found broken is Lost, anything else a bug."""
        if not isinstance(exc, psycopg.Error):
            return None
        code = exc.sqlstate
        if conn.closed or isinstance(exc, psycopg.InterfaceError):
            return Lost
        if not code:
            return Lost if isinstance(exc, psycopg.OperationalError) else StoreError
        return _BY_CODE.get(code) or _BY_CLASS.get(code[:2], StoreError)

    def _refusal(self, exc: BaseException) -> str:
        code = getattr(exc, "sqlstate", None)
        if not code:
            return super()._refusal(exc)
        what = _REFUSED.get(code[:2], "a statement")
        diag = getattr(exc, "diag", None)
        constraint = getattr(diag, "constraint_name", None)
        named = f", constraint {constraint}" if constraint else ""
        return f"the database refused {what} (SQLSTATE {code}, {type(exc).__name__}{named})"

    def _unique_key(self, exc: BaseException) -> str | None:
        return getattr(getattr(exc, "diag", None), "constraint_name", None)

    def _settle(self, token: str | None, deadline: float) -> bool | None:
        """The transaction's status from `pg_xact_status`, asked again while its backend is still finishing
        (it commits, or sees its client gone and rolls back), until `deadline`."""
        if token is None:
            return None
        while True:
            try:
                with self._connection(deadline) as conn:
                    row = conn.execute("SELECT pg_xact_status(%s::xid8)", [token]).fetchone()
            except (psycopg.Error, Busy):
                return None
            status = row[0] if row else None
            if status in ("committed", "aborted"):
                log.info("store: settled a lost COMMIT as %s", status)
                return status == "committed"
            if time.monotonic() + 0.05 >= deadline:
                return None
            time.sleep(0.05)

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        # A concurrent migrator may create the schema between the check and the insert.
        with contextlib.suppress(errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK, self.schema))
            where = f"schema {self.schema!r}"
            apply_migrations(conn.execute, self.dialect, where, "%s", self.now())

    def drop_schema(self) -> None:
        """Delete this store's schema and everything in it (the tests' clean slate)."""
        with self._connection() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))
