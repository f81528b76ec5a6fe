"""The booking store: transactions over the backend's connection pool, versioned migrations, and the SQL.

`Store.transact(fn, write=...)` runs `fn(tx)` in one database transaction and retries it when the
database reports a transient conflict (a lock timeout, a deadlock, a serialization failure, or a
unique key taken by a concurrent writer); any other exception rolls the whole transaction back.
A call that finds no free connection within the pool's wait gets `Busy`, as does one that keeps conflicting.
`Tx` holds every statement, written once with `?` placeholders; the two backends differ only in how
they pool connections, begin, lock and classify errors. Knows SQL and records, not the hotel's rules.
"""

from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import astuple, fields
from datetime import UTC, date, datetime
from importlib import resources
from typing import Any, TypeVar

from ..errors import Busy
from .records import FaqEntry, HotelPolicy, Night, Reservation, RoomType, as_date, as_datetime

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreError(Exception):
    """The database refused something the code should never ask for (a bug, not a caller error)."""


class Conflict(StoreError):
    """A concurrent writer took a unique key or changed a row first; the transaction is retried."""


class Transient(StoreError):
    """Locked, deadlocked or not serializable right now; the transaction is retried."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer version of this code."""


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


# --- statements --------------------------------------------------------------------------------------

_RES_COLUMNS = ", ".join(f.name for f in fields(Reservation))
_NIGHT_COLUMNS = "room_type, night, total, booked, rate_cents"


class Tx:
    """One open transaction. Methods run single statements; the caller composes them."""

    def __init__(self, store: Store, conn: Any):
        self._store = store
        self._conn = conn

    def _run(self, sql: str, params: Sequence[Any] = ()) -> Any:
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


class Store(ABC):
    """A booking database. Thread-safe: every call takes a pooled connection for one transaction."""

    dialect: str
    lock_clause: str = ""  # appended to a SELECT that must lock the rows it reads

    # backend hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _connection(self) -> AbstractContextManager[Any]:
        """A pooled connection, handed back to the pool afterwards; `Busy` when none is free within the
        pool's wait, StoreError once the store is closed."""

    @abstractmethod
    def _begin(self, conn: Any, write: bool) -> None: ...

    @abstractmethod
    def _commit(self, conn: Any) -> None: ...

    @abstractmethod
    def _rollback(self, conn: Any) -> None: ...

    @abstractmethod
    def _execute(self, conn: Any, sql: str, params: Sequence[Any]) -> Any: ...

    def _execute_many(self, conn: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        for row in rows:
            self._execute(conn, sql, row)

    def _param(self, value: Any) -> Any:
        return value

    @abstractmethod
    def _classify(self, exc: BaseException) -> type[StoreError] | None:
        """Conflict or Transient for errors worth retrying, None for everything else."""

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

    def transact(self, fn: Callable[[Tx], T], *, write: bool = False, attempts: int = 5) -> T:
        """Run `fn(tx)` in one transaction (`write` takes the write lock up front on SQLite).

        Retried from the start on Conflict/Transient, so `fn` must read what it decides on inside
        the transaction. Anything else rolls back and propagates unchanged; so does the last Conflict
        or Transient, as `Busy`, once `attempts` are spent."""
        for attempt in range(1, attempts + 1):
            with self._connection() as conn:
                try:
                    self._begin(conn, write)
                    result = fn(Tx(self, conn))
                    self._commit(conn)
                    return result
                except BaseException as exc:
                    self._rollback(conn)
                    kind = exc if isinstance(exc, StoreError) else None
                    retry_as = type(kind) if kind else self._classify(exc)
                    if retry_as not in (Conflict, Transient):
                        raise
                    if attempt == attempts:
                        log.warning("store: giving up after %d attempts (%s)", attempts, retry_as.__name__)
                        raise Busy() from exc
            time.sleep(random.uniform(0.002, 0.02) * attempt)
        raise AssertionError("unreachable")

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
