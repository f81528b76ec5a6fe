"""A stay against the hotel's records: the stay its policy allows, the room type a caller means, each type's
free rooms and price over the stay's nights, and what cancelling a reservation costs. Pure functions of the
store's records; no SQL, and nothing said (replies.py says it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from . import rules
from .rules import Stay
from .store import HotelPolicy, Night, Reservation, RoomType


def resolve(
    check_in: str, check_out: str | None, nights: int | None, policy: HotelPolicy, today: date
) -> Stay:
    """The stay the caller asked for, within the policy's longest stay and booking horizon."""
    return rules.resolve_stay(
        check_in,
        check_out,
        nights,
        today,
        max_nights=policy.max_nights,
        horizon_days=policy.booking_horizon_days,
    )


def match_room(text: str, rooms: dict[str, RoomType]) -> RoomType:
    """The room type the caller's words name (`rules.match_room_type`)."""
    return rooms[rules.match_room_type(text, [(r.code, r.name) for r in rooms.values()])]


@dataclass(frozen=True)
class Option:
    """One room type for one stay: how many rooms are free on every night, and the price."""

    room: RoomType
    rows: list[Night]
    stay: Stay

    @property
    def rooms_left(self) -> int:
        complete = len(self.rows) == self.stay.nights  # a night without inventory is not bookable
        return min((r.free for r in self.rows), default=0) if complete else 0

    def first_full_night(self) -> date:
        have = {r.night: r for r in self.rows}
        for night in self.stay.night_dates():
            if night not in have or have[night].free <= 0:
                return night
        raise ValueError("no night of this stay is full")

    def price(self, policy: HotelPolicy) -> rules.Price:
        return rules.price_stay([r.rate_cents for r in self.rows], policy.tax_rate_bp)


def options(rooms: dict[str, RoomType], rows: list[Night], stay: Stay) -> list[Option]:
    """One Option per room type, in the hotel's order, from inventory rows of any types."""
    by_type: dict[str, list[Night]] = {code: [] for code in rooms}
    for row in rows:
        if row.room_type in by_type:
            by_type[row.room_type].append(row)
    return [Option(rooms[code], by_type[code], stay) for code in rooms]


def cancellation_fee(r: Reservation, policy: HotelPolicy, today: date) -> int:
    """What cancelling `r` today costs, in cents."""
    return rules.cancellation_fee_cents(
        r.total_cents,
        r.nights,
        r.check_in,
        today,
        free_days=policy.free_cancel_days,
        fee_nights=policy.late_cancel_fee_nights,
    )
