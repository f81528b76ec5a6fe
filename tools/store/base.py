"""The store the backends build on: `Store.transact` runs a function in one transaction on a pooled
connection, retries it on conflicts and lost connections, and ends it by the call's deadline. Knows
transactions and how they fail; not the SQL (statements.py), the schema (schema.py) or the hotel's rules.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..errors import AlreadyExists, Busy, Unconfirmed
from .errors import Conflict, Duplicate, Lost, SchemaTooNew, StoreError, Transient, Unavailable
from .schema import LATEST_VERSION
from .statements import Tx, in_time

log = logging.getLogger(__name__)

T = TypeVar("T")

# The last seconds before a call's deadline are kept for settling a COMMIT whose answer was lost (one
# query on another connection); the transaction's own statements and retries end by then.
SETTLE_S = 1.5


# The names `Store.stats` counts a failed attempt under, by its kind; "retried": an attempt run again.
_COUNTED = {
    Conflict: "conflict",
    Duplicate: "conflict",
    Transient: "transient",
    Lost: "lost",
    Unavailable: "unavailable",
    StoreError: "refused",
}


@dataclass(frozen=True)
class _Failed:
    """One attempt of `transact` that ended in a database failure: its kind, the exception, and, when the
    failure came while COMMIT was on its way, the attempt's result and the backend's token for settling it."""

    kind: type[StoreError]
    exc: BaseException
    committing: bool = False
    result: Any = None
    token: Any = None


class Store(ABC):
    """A booking database. Thread-safe: every call takes a pooled connection for one transaction. No driver
    exception leaves it: a database error that `transact` neither retries nor answers `Busy` is a StoreError.
    The backends differ only in how they pool connections, begin, lock, bound their waits and classify
    errors. `stats()` counts the failed attempts by kind, and the attempts run again."""

    dialect: str
    lock_clause: str = ""  # appended to a SELECT that must lock the rows it reads
    migrations_table: str  # a query whose one value is 1 once the schema_migrations table exists, else 0

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys([*_COUNTED.values(), "retried"], 0)

    def stats(self) -> dict[str, int]:
        """Since the store opened: attempts that failed with a conflict, a transient failure (a lock not had
        in time, a deadlock, a serialization failure), a lost connection, the database unavailable (a
        statement timed out, the server out of resources), or a statement or value refused (a bug); and
        `retried`, the attempts run again after one of them."""
        with self._stats_lock:
            return dict(self._stats)

    def _count(self, name: str) -> None:
        with self._stats_lock:
            self._stats[name] += 1

    # backend hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _connection(self, deadline: float | None = None) -> AbstractContextManager[Any]:
        """A pooled connection whose every wait ends by `deadline` (time.monotonic(); None: no limit),
        handed back to the pool afterwards; `Busy` when none is free within the pool's wait (or by the
        deadline), StoreError once the store is closed."""

    @abstractmethod
    def _begin(self, conn: Any, write: bool, deadline: float | None) -> Any:
        """Begin a transaction whose statements end by `deadline`; returns the token `_settle` takes."""

    @abstractmethod
    def _commit(self, conn: Any) -> None: ...

    @abstractmethod
    def _rollback(self, conn: Any) -> None: ...

    def _discard(self, conn: Any) -> None:
        """Close a connection that must not go back into the pool (its pool drops closed ones)."""
        with contextlib.suppress(Exception):  # a broken connection's close may fail; it is dropped either way
            conn.close()

    @abstractmethod
    def _execute(self, conn: Any, sql: str, params: Sequence[Any]) -> Any: ...

    def _execute_many(self, conn: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        for row in rows:
            self._execute(conn, sql, row)

    def _param(self, value: Any) -> Any:
        return value

    @abstractmethod
    def _classify(self, exc: BaseException, conn: Any) -> type[StoreError] | None:
        """What a driver exception means (after `_rollback` of `conn`): Conflict or Transient (retry), Lost
        (the connection broke), Unavailable (give up at once) or StoreError (a statement refused: a bug);
        None when `exc` does not come from the database."""

    def _refusal(self, exc: BaseException) -> str:
        """What the database refused, for the StoreError's message: never the driver's own text, which
        can quote the statement's values (a guest's name)."""
        return f"the database refused a statement ({type(exc).__name__})"

    def _unique_key(self, exc: BaseException) -> str | None:
        """The unique constraint a Conflict's error names, when the driver tells it (None: unknown)."""
        return None

    def _settle(self, token: Any, deadline: float) -> bool | None:
        """Whether the write transaction `_begin` returned `token` for committed, asked on another
        connection by `deadline`: True, False, or None when that cannot be told in time."""
        return None

    @abstractmethod
    def _migrate(self, conn: Any) -> None: ...

    # public ----------------------------------------------------------------------------------------

    def migrate(self) -> int:
        """Apply every migration not yet applied; returns the schema version now in the database."""
        with self._connection() as conn:
            self._migrate(conn)
        return self.schema_version()

    def check_schema(self) -> int:
        """The schema version, checked without migrating (a room's store: the worker migrated it at start):
        a StoreError saying so when the database is not migrated to this code's version, SchemaTooNew when a
        newer code migrated it."""
        version = self.schema_version()
        if version > LATEST_VERSION:
            raise SchemaTooNew(
                f"{self!r} has schema version {version}; this code knows up to {LATEST_VERSION}"
            )
        if version < LATEST_VERSION:
            raise StoreError(
                f"{self!r} is not migrated (schema version {version}, this code needs {LATEST_VERSION}): the "
                "worker migrates it at start, as does any `python -m tools` command"
            )
        return version

    def scrub(self) -> bool:
        """Make rows deleted so far unreadable in the database's files, as far as the backend can at once;
        whether that is done. PostgreSQL's VACUUM reclaims deleted rows by itself (autovacuum)."""
        return True

    def schema_version(self) -> int:
        def read(tx: Tx) -> int:
            if not tx._rows(self.migrations_table)[0][0]:
                return 0
            rows = tx._rows("SELECT MAX(version) FROM schema_migrations")
            return int(rows[0][0] or 0)

        return self.transact(read)

    def transact(
        self,
        fn: Callable[[Tx], T],
        *,
        write: bool = False,
        attempts: int = 5,
        deadline: float | None = None,
    ) -> T:
        """Run `fn(tx)` in one transaction (`write` takes the write lock up front on SQLite; without it
        the transaction only reads, which PostgreSQL enforces).

        `deadline` (a time.monotonic() value; None: no limit) bounds the whole call: its attempts end
        SETTLE_S before it, each wait cut short by the backend when the database stops answering. A failed
        attempt is retried from the start, so `fn` must read what it decides on inside the transaction,
        while it certainly did not commit and time is left: up to `attempts` times on Conflict/Transient,
        once on another connection when the connection was Lost; otherwise the call gets `Busy`. A
        connection lost while COMMIT was on its way leaves the outcome open: the backend settles it on
        another connection, and the call returns `fn`'s result if the transaction committed, is retried if
        it did not, and gets `Unconfirmed` if that cannot be told by the deadline. A unique key taken again
        on the retry (the retry read the concurrent writer's commit, so it is no race but a duplicate), or a
        Duplicate at once, is `AlreadyExists`, not retried further. Any other database error
        becomes a StoreError; an exception of `fn`'s own (a HotelError, a bug) rolls back and propagates
        unchanged."""
        work_by = None if deadline is None else deadline - SETTLE_S
        conflicts, reconnected, unique = 0, False, None
        while True:
            outcome = self._attempt(fn, write, work_by)
            if not isinstance(outcome, _Failed):
                return outcome
            kind, exc = outcome.kind, outcome.exc
            if kind is Conflict:  # the same key again after a retry that saw the other writer's commit
                key = self._unique_key(exc) or ""
                kind, unique = (Duplicate if unique == key else kind), key
            self._count(_COUNTED.get(kind, "refused"))
            if outcome.committing and kind is Lost:
                settle_by = deadline if deadline is not None else time.monotonic() + SETTLE_S
                settled = True if not write else self._settle(outcome.token, settle_by)
                if settled:
                    if write:
                        log.warning("store: the answer to a COMMIT was lost; the transaction committed")
                    return outcome.result
                if settled is None:
                    log.warning("store: the answer to a COMMIT was lost; whether it committed is unknown")
                    raise Unconfirmed() from None
            in_time = work_by is None or time.monotonic() < work_by
            if kind is Duplicate:
                log.info("store: a unique key inserted already exists; the call is told so")
                raise AlreadyExists() from exc
            if kind in (Conflict, Transient):
                conflicts += 1
                if conflicts < attempts and in_time:
                    log.info(
                        "store: attempt %d failed (%s, %s); retrying",
                        conflicts,
                        kind.__name__,
                        type(exc).__name__,
                    )
                    self._count("retried")
                    time.sleep(random.uniform(0.002, 0.02) * conflicts)
                    continue
                log.warning("store: giving up after %d attempts (%s)", conflicts, kind.__name__)
                raise Busy() from exc
            if kind is Lost and not reconnected and in_time:
                reconnected = True
                log.warning("store: connection lost (%s); retrying on another", type(exc).__name__)
                self._count("retried")
                continue
            if kind in (Lost, Unavailable):
                log.warning(
                    "store: %s (%s); the call is told busy", kind.__name__.lower(), type(exc).__name__
                )
                raise Busy() from exc
            refusal = self._refusal(exc)
            log.error("store: %s", refusal)
            raise StoreError(refusal) from exc

    def _attempt(self, fn: Callable[[Tx], T], write: bool, deadline: float | None) -> T | _Failed:
        """One run of `fn` in one transaction: its result, or how it failed in the database."""
        committing, result, token = False, None, None
        with self._connection(deadline) as conn:
            try:
                token = self._begin(conn, write, deadline)
                result = fn(Tx(self, conn, deadline))
                in_time(deadline)
                committing = True
                self._commit(conn)
                return result
            except BaseException as exc:
                self._rollback(conn)
                if isinstance(exc, StoreError):
                    kind: type[StoreError] | None = type(exc)
                    if kind not in (Conflict, Duplicate, Transient, Lost, Unavailable):
                        self._count("refused")
                        raise
                else:
                    kind = self._classify(exc, conn)
                    if kind is None:
                        raise
                if kind is Lost:
                    self._discard(conn)
                return _Failed(kind, exc, committing, result, token)

    @abstractmethod
    def close(self) -> None:
        """Close the pool: idle connections now, the ones in use as they are handed back."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)
