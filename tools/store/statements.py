"""Every SQL statement the hotel runs, written once with `?` placeholders, as the methods of `Tx`, one open
transaction. Knows the tables and the records; not how a backend begins, commits, retries or bounds a wait
beyond refusing to send a statement after the call's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import astuple, fields
from datetime import date, datetime
from typing import Any, Protocol

from .errors import StoreError, Unavailable
from .records import FaqEntry, HotelPolicy, Night, Reservation, RoomType, as_date, as_datetime


class Backend(Protocol):
    """What a transaction runs its statements through (tools/store/base.py `Store`, per database)."""

    lock_clause: str

    def _execute(self, conn: Any, sql: str, params: Sequence[Any]) -> Any: ...

    def _execute_many(self, conn: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    def _param(self, value: Any) -> Any: ...

    def now(self) -> datetime: ...


def in_time(deadline: float | None) -> None:
    """Unavailable once `deadline` has passed: nothing more is sent to the database."""
    if deadline is not None and time.monotonic() >= deadline:
        raise Unavailable("the call's deadline passed")


# The largest whole number an INTEGER column holds on both backends (PostgreSQL's are 4 bytes, SQLite's 8).
INTEGER_MAX = 2**31 - 1


def _fits_integer(what: str, value: object, low: int = -INTEGER_MAX - 1) -> None:
    """StoreError, saying which value and why, unless `value` is a whole number from `low` to INTEGER_MAX:
    refused before the statement, so both backends refuse it alike (SQLite's driver would raise
    OverflowError past 64 bits, PostgreSQL's server an out-of-range error)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= INTEGER_MAX:
        if isinstance(value, int) and value.bit_length() > 96:  # too long to read (or for int's repr)
            shown = f"a number of {value.bit_length()} bits"
        else:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
        raise StoreError(
            f"{what} is {shown}, out of range: it must be a whole number from {low:,} to {INTEGER_MAX:,}"
        )


_RES_COLUMNS = ", ".join(f.name for f in fields(Reservation))
_NIGHT_COLUMNS = "room_type, night, total, booked, rate_cents"


class Tx:
    """One open transaction. Methods run single statements; the caller composes them."""

    def __init__(self, store: Backend, conn: Any, deadline: float | None = None):
        self._store = store
        self._conn = conn
        self._deadline = deadline  # time.monotonic() by which every statement must be answered

    def _run(self, sql: str, params: Sequence[Any] = ()) -> Any:
        in_time(self._deadline)
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
        for f in fields(HotelPolicy):
            if f.type in (int, "int"):  # a string under `from __future__ import annotations`
                _fits_integer(f"the hotel's {f.name}", getattr(policy, f.name))
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
        _fits_integer(f"{room.code}'s max_guests", room.max_guests)
        _fits_integer(f"{room.code}'s sort_order", room.sort_order)
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
        for n in nights:
            _fits_integer(f"the nightly rate in cents for {n.room_type} on {n.night}", n.rate_cents, 0)
            _fits_integer(f"the number of {n.room_type} rooms on {n.night}", n.total, 0)
        rows = [
            [self._store._param(v) for v in (n.room_type, n.night, n.total, n.rate_cents)] for n in nights
        ]
        if rows:
            in_time(self._deadline)
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

    # conversations (agent/fleet/carry.py)
    # ----------------------------------------------------------------------

    def conversation(self, room_sid: str) -> str | None:
        """The conversation kept for a room (its JSON), or None."""
        rows = self._rows("SELECT state FROM conversations WHERE room_sid = ?", [room_sid])
        return rows[0][0] if rows else None

    def put_conversation(self, room_sid: str, state: str, at: datetime | None = None) -> None:
        """Keep a room's conversation (replacing what was kept), written at `at` (now by default)."""
        self._run(
            "INSERT INTO conversations (room_sid, state, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (room_sid) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            [room_sid, state, at or self._store.now()],
        )

    def delete_conversation(self, room_sid: str) -> None:
        self._run("DELETE FROM conversations WHERE room_sid = ?", [room_sid])

    def purge_conversations(self, before: datetime) -> int:
        """Delete the conversations last written before `before`; how many."""
        return int(self._run("DELETE FROM conversations WHERE updated_at < ?", [before]).rowcount or 0)

    def update_reservation(self, r: Reservation) -> None:
        names = [f.name for f in fields(Reservation) if f.name not in ("code", "created_at")]
        cur = self._run(
            f"UPDATE reservations SET {', '.join(f'{n} = ?' for n in names)} WHERE code = ?",
            [getattr(r, n) for n in names] + [r.code],
        )
        if cur.rowcount != 1:
            raise StoreError("updated a reservation that does not exist")
