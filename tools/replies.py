"""What the tools say: room options for a stay, sold-out and too-many-guests answers, and a reservation
as the model reads it. Pure functions of records; no database, no LiveKit."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Any

from . import rules
from .errors import InvalidRequest, SoldOut
from .rules import Stay, money, spoken_date, spoken_night
from .store import HotelPolicy, Night, Reservation, RoomType


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


def too_many_guests(room: RoomType, guests: int, rooms: dict[str, RoomType]) -> InvalidRequest:
    text = f"The {room.name} sleeps at most {room.max_guests}."
    bigger = [r for r in rooms.values() if r.max_guests >= guests]
    if bigger:
        text += f" For {guests} guests, the {bigger[0].name} sleeps {bigger[0].max_guests}."
    else:
        largest = max(rooms.values(), key=lambda r: r.max_guests)
        text += f" Our largest room, the {largest.name}, sleeps {largest.max_guests};"
        text += f" {guests} guests need two rooms."
    return InvalidRequest(text)


def sold_out(wanted: Option, everything: list[Option], guests: int, policy: HotelPolicy) -> SoldOut:
    """`No Deluxe King rooms are left on Friday the 12th; a Standard Queen is available ... at $X.`"""
    text = f"No {wanted.room.name} rooms are left on {spoken_night(wanted.first_full_night())}"
    others = [
        o
        for o in everything
        if o.room.code != wanted.room.code and o.rooms_left > 0 and o.room.max_guests >= guests
    ]
    if others:
        total = money(others[0].price(policy).total_cents, policy.currency)
        text += f"; a {others[0].room.name} is available for those dates at {total} including tax."
    else:
        text += "; no other room is free for those dates either."
    return SoldOut(text)


def cancellation_fee(r: Reservation, policy: HotelPolicy, today: date) -> int:
    return rules.cancellation_fee_cents(
        r.total_cents,
        r.nights,
        r.check_in,
        today,
        free_days=policy.free_cancel_days,
        fee_nights=policy.late_cancel_fee_nights,
    )


def cancellation_terms(r: Reservation, policy: HotelPolicy, today: date) -> str:
    fee = cancellation_fee(r, policy, today)
    if fee == 0:
        until = rules.free_cancellation_until(r.check_in, policy.free_cancel_days)
        return f"Free cancellation until {spoken_date(until, today)}."
    return f"Cancelling now costs {money(fee, policy.currency)}."


def reservation_view(
    r: Reservation, rooms: dict[str, RoomType], policy: HotelPolicy, today: date
) -> dict[str, Any]:
    """A reservation as the model reads it (never the guest's contact details)."""
    view: dict[str, Any] = {
        "confirmation_code": r.code,
        "confirmation_code_spoken": rules.spoken_code(r.code),
        "status": r.status,
        "guest_name": r.guest_name,
        "room_type": rooms[r.room_type].name if r.room_type in rooms else r.room_type,
        "check_in": r.check_in.isoformat(),
        "check_out": r.check_out.isoformat(),
        "dates": Stay(r.check_in, r.check_out).spoken(today),
        "nights": r.nights,
        "guests": r.guests,
        "total": money(r.total_cents, policy.currency),
        "tax_included": money(r.tax_cents, policy.currency),
    }
    if r.status == "confirmed":
        view["cancellation"] = cancellation_terms(r, policy, today)
    elif r.cancellation_fee_cents:
        view["cancellation_fee"] = money(r.cancellation_fee_cents, policy.currency)
    return view
