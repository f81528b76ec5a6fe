"""Consistency check of a booking database: inventory counts against the reservations that hold them.
Reads through the store's statements and changes nothing; knows no SQL.
"""

from __future__ import annotations

from datetime import date

from .rules import Stay
from .store import Store, Tx


def audit(store: Store) -> list[str]:
    """Every way the database disagrees with itself: a night's booked count that is not the number of
    confirmed reservations covering it, more booked than rooms, a confirmed stay with no inventory.
    Empty when consistent."""

    def run(tx: Tx) -> list[str]:
        expected: dict[tuple[str, date], int] = {}
        for r in tx.reservations(status="confirmed"):
            for night in Stay(r.check_in, r.check_out).night_dates():
                expected[(r.room_type, night)] = expected.get((r.room_type, night), 0) + 1
        problems: list[str] = []
        seen = set()
        for row in tx.nights([(None, date(1970, 1, 1), date(9999, 1, 1))]):
            seen.add((row.room_type, row.night))
            want = expected.get((row.room_type, row.night), 0)
            if row.booked != want:
                problems.append(f"{row.room_type} {row.night}: booked {row.booked}, reservations {want}")
            if not 0 <= row.booked <= row.total:
                problems.append(f"{row.room_type} {row.night}: booked {row.booked} of {row.total}")
        problems += [f"{t} {n}: reserved but no inventory row" for t, n in expected if (t, n) not in seen]
        return problems

    return store.transact(run)
