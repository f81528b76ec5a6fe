"""SQLite backend: one file in WAL mode, writers serialised by `BEGIN IMMEDIATE`, connections from a small
pool of its own, and every wait bounded by a busy timeout and the call's deadline. The file and its -wal and
-shm are the owner's alone (files.py); deleted rows are overwritten (`secure_delete`) and `scrub` empties the
WAL. Knows SQLite's locking and result codes; not the statements it runs (statements.py) or when a
transaction is retried (base.py).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import date, datetime
from pathlib import Path
from typing import Any

from ..errors import Busy
from .base import Store
from .errors import Duplicate, Lost, StoreError, Transient, Unavailable
from .files import private_database
from .schema import LATEST_VERSION, apply_migrations

log = logging.getLogger(__name__)


class Pool:
    """At most `size` connections, created on demand, reused LIFO; a broken one is dropped. A caller waits
    at most `wait_s` for one to be free, then gets `Busy`."""

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        *,
        size: int,
        wait_s: float,
        healthy: Callable[[sqlite3.Connection], bool],
    ):
        if size < 1:
            raise ValueError("pool size must be at least 1")
        if not wait_s > 0:
            raise ValueError("the wait for a connection must be above 0 s")
        self._connect, self._healthy = connect, healthy
        self._size, self._wait_s = size, wait_s
        self._idle: list[sqlite3.Connection] = []
        self._open = 0
        self._closed = False
        self._cond = threading.Condition()

    @contextmanager
    def connection(self, deadline: float | None = None) -> Iterator[sqlite3.Connection]:
        """A connection, waited for at most `wait_s` and not past `deadline` (time.monotonic())."""
        wait_s = self._wait_s if deadline is None else min(self._wait_s, deadline - time.monotonic())
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._idle and self._open >= self._size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("store: no free SQLite connection within %.1f s", max(wait_s, 0.0))
                    raise Busy()
                self._cond.wait(left)
            if self._closed:
                raise StoreError("the store is closed")
            conn = self._idle.pop() if self._idle else None
            if conn is None:
                self._open += 1
        if conn is None:
            try:
                conn = self._connect()
            except BaseException:
                with self._cond:
                    self._open -= 1
                    self._cond.notify()
                raise
        try:
            yield conn
        finally:
            keep = not self._closed and self._healthy(conn)
            if not keep:
                _close(conn)
            with self._cond:
                if keep:
                    self._idle.append(conn)
                else:
                    self._open -= 1
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            _close(conn)


def _close(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(Exception):  # closing a broken connection may fail; nothing to do
        conn.close()


@contextmanager
def _whole_numbers() -> Iterator[None]:
    """sqlite3 raises OverflowError, no database error, for a parameter past SQLite's 64-bit integers."""
    try:
        yield
    except OverflowError:
        raise StoreError("the database refused a whole number larger than its 64-bit integers") from None


# SQLite's primary result codes (https://sqlite.org/rescode.html) by what they mean for a transaction.
_LOCKED = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED: the lock was not had within the busy timeout
_BROKEN = {7, 10, 11, 14, 15, 26}  # NOMEM, IOERR, CORRUPT, CANTOPEN, PROTOCOL, NOTADB: reopen the file
_REFUSED_NOW = {8, 9, 13}  # READONLY, INTERRUPT, FULL: the database cannot take the write now


class SqliteStore(Store):
    """WAL lets readers run beside the single writer; `BEGIN IMMEDIATE` takes the write lock before the
    first read, so a booking's availability check and its update see the same rows (no lock upgrade,
    no SQLITE_BUSY_SNAPSHOT). `synchronous=FULL`: a committed booking survives a power cut. A call that
    finds no pooled connection free within `wait_s` gets `Busy`.

    The busy timeout (how long a writer waits for the write lock) is at most `busy_timeout_s`, and for a
    transaction with a deadline, what is left of it. Errors are classified as on PostgreSQL: a lock not had
    in time is retried until the deadline, an I/O-level failure drops the connection and retries once on a
    fresh one, and anything else from SQLite is a `StoreError`."""

    dialect = "sqlite"
    migrations_table = (
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    )

    def __init__(
        self,
        path: str | Path,
        *,
        pool_size: int = 8,
        wait_s: float = 5.0,
        busy_timeout_s: float = 5.0,
        migrate: bool = True,
    ):
        """`migrate`: create the file (0600, in a folder made 0700) and bring its schema up to date, as the
        worker does once at start and the tools' commands do. Without it (a room's process) the file must
        exist and be migrated already: it is opened read-write, never created, and a schema older or newer
        than this code's is refused with a StoreError; nothing waits for the write lock."""
        super().__init__()
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        if migrate:
            try:
                private_database(self.path)
            except OSError as e:
                raise StoreError(
                    f"the booking database {self.path} cannot be created ({type(e).__name__}: {e.strerror})"
                ) from None
        self._pool = Pool(self._connect, size=pool_size, wait_s=wait_s, healthy=self._healthy)
        try:
            self.migrate() if migrate else self.check_schema()
        except Busy:
            self._pool.close()
            raise StoreError(
                f"the booking database {self.path} stayed locked by another process for "
                f"{busy_timeout_s:g} s while it was opened; try again"
            ) from None
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r})"

    def _connect(self) -> sqlite3.Connection:
        """A connection to the existing file (`mode=rw`: SQLite never creates it here, with the process's
        umask); a file that cannot be opened is a StoreError, a lock not had in time `Busy`."""
        uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=rw"
        conn = None
        try:
            # isolation_level=None: no implicit transactions; we issue BEGIN/COMMIT ourselves.
            conn = sqlite3.connect(
                uri, uri=True, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA secure_delete = ON")  # a deleted row's bytes are overwritten, not left
            return conn
        except sqlite3.Error as exc:
            if conn is not None:
                _close(conn)
            if _locked(exc):
                log.warning("store: the SQLite file stayed locked while a connection was opened")
                raise Busy() from None
            raise StoreError(
                f"the booking database {self.path} cannot be opened ({_name(exc)}): it must exist, be "
                "readable and writable by this user, and be migrated (the worker migrates it at start)"
            ) from None

    def _healthy(self, conn: sqlite3.Connection) -> bool:
        try:
            return not conn.in_transaction
        except sqlite3.ProgrammingError:  # closed
            return False

    def _connection(
        self, deadline: float | None = None
    ) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self._pool.connection(deadline)

    def close(self) -> None:
        self._pool.close()

    def _begin(self, conn: sqlite3.Connection, write: bool, deadline: float | None) -> None:
        wait_s = self._busy_timeout_s
        if deadline is not None:
            wait_s = min(wait_s, deadline - time.monotonic())
        conn.execute(f"PRAGMA busy_timeout = {max(1, int(wait_s * 1000))}")
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def _commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def _execute(self, conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> sqlite3.Cursor:
        with _whole_numbers():
            return conn.execute(sql, params)

    def _execute_many(self, conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with _whole_numbers():
            conn.executemany(sql, rows)

    def _param(self, value: Any) -> Any:
        # Dates and times as ISO text (the stdlib's implicit adapters are deprecated).
        if isinstance(value, datetime | date):
            return value.isoformat()
        return value

    def _classify(self, exc: BaseException, conn: sqlite3.Connection) -> type[StoreError] | None:
        """A UNIQUE violation is a Duplicate at once: writers hold the write lock from their first read, so
        what they read is what they insert against, and no concurrent writer can have taken the key."""
        if not isinstance(exc, sqlite3.Error):
            return None
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
        if isinstance(exc, sqlite3.IntegrityError) and "UNIQUE" in str(exc):
            return Duplicate
        if _locked(exc):
            return Transient
        if code in _BROKEN:
            return Lost
        if code in _REFUSED_NOW:
            return Unavailable
        return StoreError

    def _refusal(self, exc: BaseException) -> str:
        return f"the database refused a statement ({_name(exc)})"

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Takes the write lock only when a migration is missing: a worker that starts while another
        process holds that lock (a room's write that hangs) finds its schema current and goes on."""
        try:
            if _version(conn) == LATEST_VERSION:
                return
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            conn.execute("BEGIN IMMEDIATE")
            try:
                apply_migrations(conn.execute, self.dialect, str(self.path), "?", self.now().isoformat())
                conn.execute("COMMIT")
            except BaseException:
                self._rollback(conn)
                raise
        except sqlite3.Error as exc:
            why = "another process held its write lock" if _locked(exc) else _name(exc)
            raise StoreError(f"the booking database {self.path} could not be migrated ({why})") from None

    def scrub(self) -> bool:
        """Move the WAL's pages into the file and truncate the WAL to nothing (`wal_checkpoint(TRUNCATE)`),
        so a deleted row's older versions in it are gone; waits at most SCRUB_WAIT_S for the writers and
        readers of other connections. False when one kept it from finishing (the next scrub does it)."""
        try:
            with self._pool.connection() as conn:
                conn.execute(f"PRAGMA busy_timeout = {int(SCRUB_WAIT_S * 1000)}")
                try:
                    busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        except (sqlite3.Error, Busy) as exc:  # Busy: no pooled connection free in time
            log.warning("store: the WAL was not emptied (%s)", _name(exc))
            return False
        return not busy


SCRUB_WAIT_S = 1.0  # how long `scrub` waits for other connections to let the WAL be emptied


def _locked(exc: sqlite3.Error) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED: a lock another connection holds was not had in time."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    return code in _LOCKED or (isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower())


def _name(exc: BaseException) -> str:
    """SQLite's name for the error (SQLITE_CONSTRAINT_CHECK): no values, unlike its text."""
    return getattr(exc, "sqlite_errorname", None) or type(exc).__name__


def _version(conn: sqlite3.Connection) -> int:
    """The schema version the file holds (0: none yet), read without a lock."""
    found = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()[0]
    if not found:
        return 0
    return int(conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] or 0)
