"""The booking store: transactions over the backend's connection pool, versioned migrations, and the SQL.

`Store.transact(fn, write=..., deadline=...)` runs `fn(tx)` in one database transaction and retries it when
the database reports a transient conflict (a lock timeout, a deadlock, a serialization failure, or a
unique key taken by a concurrent writer), or once on another connection when its connection broke before
COMMIT was sent; any other exception rolls the whole transaction back. With a `deadline` every wait ends
by then: the call gets `Busy` when the work did not commit, and `Unconfirmed` when a COMMIT was sent but
its answer never came and the database could not say in time whether it took (see `transact`). No driver
exception leaves the store: a database error that is none of these is a `StoreError`.
`Tx` holds every statement, written once with `?` placeholders; the two backends differ only in how
they pool connections, begin, lock, bound their waits and classify errors. Knows SQL and records, not the
hotel's rules.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import astuple, dataclass, fields
from datetime import UTC, date, datetime
from importlib import resources
from typing import Any, TypeVar

from ..errors import Busy, Unconfirmed
from .records import FaqEntry, HotelPolicy, Night, Reservation, RoomType, as_date, as_datetime

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreError(Exception):
    """The database refused something the code should never ask for (a bug, not a caller error)."""


class Conflict(StoreError):
    """A concurrent writer took a unique key or changed a row first; the transaction is retried."""


class Transient(StoreError):
    """Locked, deadlocked or not serializable right now; the transaction is retried."""


class Lost(StoreError):
    """The connection broke (the server restarted or ended it, the network failed, or it was cut at the
    call's deadline); the transaction is retried once on another connection."""


class Unavailable(StoreError):
    """The database cannot serve this now (a statement timed out, the call's deadline passed, the server is
    out of resources); the caller is told `Busy` at once."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer version of this code."""


# The last seconds before a call's deadline are kept for settling a COMMIT whose answer was lost (one
# query on another connection); the transaction's own statements and retries end by then.
SETTLE_S = 1.5


# --- migrations --------------------------------------------------------------------------------------


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """(version, name, sql) for every `NNNN_name.<dialect>.sql` file, in version order."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        parts = entry.name.split(".")
        if len(parts) == 3 and parts[1] == dialect and parts[2] == "sql":
            version, _, name = parts[0].partition("_")
            found.append((int(version), name, entry.read_text(encoding="utf-8")))
    found.sort()
    if [v for v, _, _ in found] != list(range(1, len(found) + 1)):
        raise StoreError(f"migration versions for {dialect} are not 1..n: {[v for v, _, _ in found]}")
    return found


def statements(sql: str) -> list[str]:
    """Split a migration file on semicolons that end a line (our files hold no procedural code)."""
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return [part.strip() for part in "\n".join(lines).split(";\n") if part.strip().rstrip(";").strip()]


LATEST_VERSION = len(migrations("sqlite"))


def apply_migrations(
    run: Callable[..., Any], dialect: str, where: str, applied_at_type: str, mark: str, now: Any
) -> None:
    """Bring a store's schema to the newest version this code knows, inside the caller's transaction (which
    holds whatever lock keeps two migrators apart). `run(statement, params=())` executes one statement and
    returns its rows; `mark` is the driver's parameter mark, `now` the time recorded per migration. A schema
    newer than this code is SchemaTooNew (`where` names the database in the message)."""
    run(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        f"(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at {applied_at_type} NOT NULL)"
    )
    applied = {row[0] for row in run("SELECT version FROM schema_migrations")}
    known = migrations(dialect)
    if applied and max(applied) > len(known):
        raise SchemaTooNew(f"{where} has schema version {max(applied)}; this code knows up to {len(known)}")
    for version, name, text in known:
        if version in applied:
            continue
        for statement in statements(text):
            run(statement)
        run(
            f"INSERT INTO schema_migrations (version, name, applied_at) VALUES ({mark}, {mark}, {mark})",
            (version, name, now),
        )


# --- statements --------------------------------------------------------------------------------------

_RES_COLUMNS = ", ".join(f.name for f in fields(Reservation))
_NIGHT_COLUMNS = "room_type, night, total, booked, rate_cents"


class Tx:
    """One open transaction. Methods run single statements; the caller composes them."""

    def __init__(self, store: Store, conn: Any, deadline: float | None = None):
        self._store = store
        self._conn = conn
        self._deadline = deadline  # time.monotonic() by which every statement must be answered

    def _run(self, sql: str, params: Sequence[Any] = ()) -> Any:
        _in_time(self._deadline)
        return self._store._execute(self._conn, sql, [self._store._param(p) for p in params])

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._run(sql, params).fetchall())

    # hotel ------------------------------------------------------------------------------------------

    def hotel(self) -> HotelPolicy | None:
        cols = ", ".join(f.name for f in fields(HotelPolicy))
        rows = self._rows(f"SELECT {cols} FROM hotel WHERE id = 1")
        return HotelPolicy(*rows[0]) if rows else None

    def put_hotel(self, policy: HotelPolicy) -> None:
        names = [f.name for f in fields(HotelPolicy)]
        updates = ", ".join(f"{n} = excluded.{n}" for n in names)
        self._run(
            f"INSERT INTO hotel (id, {', '.join(names)}) VALUES (1, {', '.join('?' * len(names))}) "
            f"ON CONFLICT (id) DO UPDATE SET {updates}",
            astuple(policy),
        )

    def room_types(self) -> list[RoomType]:
        rows = self._rows(
            "SELECT code, name, description, max_guests, sort_order FROM room_types ORDER BY sort_order, code"
        )
        return [RoomType(*row) for row in rows]

    def put_room_type(self, room: RoomType) -> None:
        self._run(
            "INSERT INTO room_types (code, name, description, max_guests, sort_order) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (code) DO UPDATE SET name = excluded.name, description = excluded.description, "
            "max_guests = excluded.max_guests, sort_order = excluded.sort_order",
            astuple(room),
        )

    def faq(self) -> list[FaqEntry]:
        return [
            FaqEntry(*row) for row in self._rows("SELECT topic, keywords, answer FROM faq ORDER BY topic")
        ]

    def put_faq(self, entry: FaqEntry) -> None:
        self._run(
            "INSERT INTO faq (topic, keywords, answer) VALUES (?, ?, ?) "
            "ON CONFLICT (topic) DO UPDATE SET keywords = excluded.keywords, answer = excluded.answer",
            astuple(entry),
        )

    # inventory --------------------------------------------------------------------------------------

    def nights(self, ranges: Sequence[tuple[str | None, date, date]], *, lock: bool = False) -> list[Night]:
        """Inventory rows for each (room type or None for all, first night, day after the last night),
        ordered by room type and night. `lock` takes row locks in that order (PostgreSQL), so two
        writers never wait on each other in opposite orders."""
        where, params = [], []
        for room_type, start, end in ranges:
            if room_type is None:
                where.append("(night >= ? AND night < ?)")
                params += [start, end]
            else:
                where.append("(room_type = ? AND night >= ? AND night < ?)")
                params += [room_type, start, end]
        sql = f"SELECT {_NIGHT_COLUMNS} FROM inventory WHERE {' OR '.join(where)} ORDER BY room_type, night"
        if lock:
            sql += self._store.lock_clause
        return [Night(r[0], as_date(r[1]), r[2], r[3], r[4]) for r in self._rows(sql, params)]

    def add_booked(self, room_type: str, start: date, end: date, delta: int) -> int:
        """Booked count += delta on each night in [start, end); returns the number of rows changed.
        The table's CHECK (0 <= booked <= total) refuses an overbooking even if a caller forgot to lock."""
        cur = self._run(
            "UPDATE inventory SET booked = booked + ? WHERE room_type = ? AND night >= ? AND night < ?",
            [delta, room_type, start, end],
        )
        return cur.rowcount

    def put_nights(self, nights: Sequence[Night], *, replace: bool = False) -> None:
        """Create inventory rows (booked 0). An existing row is kept, or with `replace` gets the new
        total and rate (the CHECK refuses a total below what is already booked)."""
        on_conflict = (
            "DO UPDATE SET total = excluded.total, rate_cents = excluded.rate_cents"
            if replace
            else "DO NOTHING"
        )
        rows = [
            [self._store._param(v) for v in (n.room_type, n.night, n.total, n.rate_cents)] for n in nights
        ]
        if rows:
            _in_time(self._deadline)
            self._store._execute_many(
                self._conn,
                f"INSERT INTO inventory ({_NIGHT_COLUMNS}) VALUES (?, ?, ?, 0, ?) "
                f"ON CONFLICT (room_type, night) {on_conflict}",
                rows,
            )

    # reservations -----------------------------------------------------------------------------------

    def _reservation(self, row: Sequence[Any]) -> Reservation:
        r = Reservation(*row)
        return r.but(
            check_in=as_date(r.check_in),
            check_out=as_date(r.check_out),
            created_at=as_datetime(r.created_at),
            updated_at=as_datetime(r.updated_at),
        )

    def reservation(self, code: str, *, lock: bool = False) -> Reservation | None:
        sql = f"SELECT {_RES_COLUMNS} FROM reservations WHERE code = ?"
        rows = self._rows(sql + (self._store.lock_clause if lock else ""), [code])
        return self._reservation(rows[0]) if rows else None

    def reservation_by_key(self, idempotency_key: str) -> Reservation | None:
        rows = self._rows(
            f"SELECT {_RES_COLUMNS} FROM reservations WHERE idempotency_key = ?", [idempotency_key]
        )
        return self._reservation(rows[0]) if rows else None

    def reservations(self, *, status: str | None = None) -> list[Reservation]:
        sql = f"SELECT {_RES_COLUMNS} FROM reservations"
        params: list[Any] = []
        if status is not None:
            sql += " WHERE status = ?"
            params.append(status)
        rows = self._rows(sql + " ORDER BY check_in, created_at, code", params)
        return [self._reservation(row) for row in rows]

    def latest_reservations(self, limit: int) -> list[Reservation]:
        """The `limit` reservations made last, newest first (for the monitoring page)."""
        rows = self._rows(
            f"SELECT {_RES_COLUMNS} FROM reservations ORDER BY created_at DESC, code DESC LIMIT ?",
            [int(limit)],
        )
        return [self._reservation(row) for row in rows]

    def insert_reservation(self, r: Reservation) -> None:
        self._run(
            f"INSERT INTO reservations ({_RES_COLUMNS}) VALUES ({', '.join('?' * len(fields(Reservation)))})",
            astuple(r),
        )

    def update_reservation(self, r: Reservation) -> None:
        names = [f.name for f in fields(Reservation) if f.name not in ("code", "created_at")]
        cur = self._run(
            f"UPDATE reservations SET {', '.join(f'{n} = ?' for n in names)} WHERE code = ?",
            [getattr(r, n) for n in names] + [r.code],
        )
        if cur.rowcount != 1:
            raise StoreError("updated a reservation that does not exist")


# --- the store ---------------------------------------------------------------------------------------


def _in_time(deadline: float | None) -> None:
    """Unavailable once `deadline` has passed: nothing more is sent to the database."""
    if deadline is not None and time.monotonic() >= deadline:
        raise Unavailable("the call's deadline passed")


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
    """A booking database. Thread-safe: every call takes a pooled connection for one transaction."""

    dialect: str
    lock_clause: str = ""  # appended to a SELECT that must lock the rows it reads

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
        with contextlib.suppress(Exception):
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

    def schema_version(self) -> int:
        def read(tx: Tx) -> int:
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
        it did not, and gets `Unconfirmed` if that cannot be told by the deadline. Any other database error
        becomes a StoreError; an exception of `fn`'s own (a HotelError, a bug) rolls back and propagates
        unchanged."""
        work_by = None if deadline is None else deadline - SETTLE_S
        conflicts, reconnected = 0, False
        while True:
            outcome = self._attempt(fn, write, work_by)
            if not isinstance(outcome, _Failed):
                return outcome
            kind, exc = outcome.kind, outcome.exc
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
            if kind in (Conflict, Transient):
                conflicts += 1
                if conflicts < attempts and in_time:
                    time.sleep(random.uniform(0.002, 0.02) * conflicts)
                    continue
                log.warning("store: giving up after %d attempts (%s)", conflicts, kind.__name__)
                raise Busy() from exc
            if kind is Lost and not reconnected and in_time:
                reconnected = True
                log.warning("store: connection lost (%s); retrying on another", type(exc).__name__)
                continue
            if kind in (Lost, Unavailable):
                log.warning(
                    "store: %s (%s); the call is told busy", kind.__name__.lower(), type(exc).__name__
                )
                raise Busy() from exc
            raise StoreError(f"the database refused a statement ({type(exc).__name__})") from exc

    def _attempt(self, fn: Callable[[Tx], T], write: bool, deadline: float | None) -> T | _Failed:
        """One run of `fn` in one transaction: its result, or how it failed in the database."""
        committing, result, token = False, None, None
        with self._connection(deadline) as conn:
            try:
                token = self._begin(conn, write, deadline)
                result = fn(Tx(self, conn, deadline))
                _in_time(deadline)
                committing = True
                self._commit(conn)
                return result
            except BaseException as exc:
                self._rollback(conn)
                if isinstance(exc, StoreError):
                    kind: type[StoreError] | None = type(exc)
                    if kind not in (Conflict, Transient, Lost, Unavailable):
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
