"""What the tools say: the sentences of every answer and refusal the hotel's operations give (a failure of
the system itself carries its own, errors.py), a reservation as the model reads it, and `ResultWriter`, which
writes an answer as the JSON text the model reads. Pure functions of the store's records and a stay's
options (the writer keeps only its counts); no database, and no decisions.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from datetime import date
from typing import Any

from . import rules
from .errors import HotelError, InvalidRequest, SoldOut
from .rules import Stay, counted, money, spoken_date, spoken_night
from .stays import Option, cancellation_fee
from .store import HotelPolicy, Reservation, RoomType

NOT_FOUND = (
    "I couldn't find a reservation with that confirmation code and last name. "
    "Could you read me the code again, one character at a time?"
)
KEY_REUSED = (
    "This request key was already used for a booking with other details; a different booking needs a new key."
)
ALREADY_CANCELLED = "That reservation is already cancelled; I can make a new booking instead."
ALREADY_STARTED = "That stay has already started, so the front desk needs to make any change."
WHAT_TO_CHANGE = "What should change: the dates, the room type or the number of guests?"


def _total(option: Option, policy: HotelPolicy) -> str:
    return money(option.price(policy).total_cents, policy.currency)


# --- refusals ----------------------------------------------------------------------------------------


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


def sold_out(
    wanted: Option, everything: list[Option], guests: int, policy: HotelPolicy, *, changing: bool = False
) -> SoldOut:
    """`No Deluxe King rooms are left on Friday the 12th; a Standard Queen is available ... at $X.`, and when
    `changing` a reservation, that it is unchanged."""
    text = f"No {wanted.room.name} rooms are left on {spoken_night(wanted.first_full_night())}"
    others = [
        o
        for o in everything
        if o.room.code != wanted.room.code and o.rooms_left > 0 and o.room.max_guests >= guests
    ]
    if others:
        total = _total(others[0], policy)
        text += f"; a {others[0].room.name} is available for those dates at {total} including tax."
    else:
        text += "; no other room is free for those dates either."
    if changing:
        text += " The reservation is unchanged."
    return SoldOut(text)


# --- answers -----------------------------------------------------------------------------------------


def availability(
    stay: Stay,
    options: list[Option],
    wanted: RoomType | None,
    guests: int,
    rooms: dict[str, RoomType],
    policy: HotelPolicy,
    today: date,
) -> dict[str, Any]:
    """The answer to a check of availability over every room type's `options` for `stay`, about the
    `wanted` type or, without one, the types that sleep `guests`."""
    fitting = [o for o in options if o.room.max_guests >= guests]
    free = [o for o in fitting if o.rooms_left > 0]
    result: dict[str, Any] = {
        "check_in": stay.check_in.isoformat(),
        "check_out": stay.check_out.isoformat(),
        "dates": stay.spoken(today),
        "guests": guests,
        "available": [
            {
                "room_type": o.room.name,
                "sleeps": o.room.max_guests,
                "rooms_left": o.rooms_left,
                "total": _total(o, policy),
                "description": o.room.description,
            }
            for o in free
        ],
    }
    if wanted is not None:
        option = next(o for o in options if o.room.code == wanted.code)
        if wanted.max_guests < guests:
            result["message"] = too_many_guests(wanted, guests, rooms).message
        elif option.rooms_left == 0:
            result["message"] = sold_out(option, options, guests, policy).message
        else:
            result["message"] = (
                f"Yes, a {wanted.name} is available {stay.spoken(today)}, "
                f"for {_total(option, policy)} including tax."
            )
    elif not fitting:
        largest = max(rooms.values(), key=lambda r: r.max_guests)
        result["message"] = too_many_guests(largest, guests, rooms).message
    elif not free:
        result["message"] = f"We're fully booked {stay.spoken(today)}."
    else:
        offers = "; ".join(f"{o.room.name}, {_total(o, policy)}" for o in free)
        result["message"] = f"Available {stay.spoken(today)}, totals including tax: {offers}."
    return result


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


def booked(
    r: Reservation, repeated: bool, rooms: dict[str, RoomType], policy: HotelPolicy, today: date
) -> dict[str, Any]:
    """A booking made, or, `repeated`, the one made before with the same key."""
    view = reservation_view(r, rooms, policy, today)
    view["already_booked"] = repeated
    what = "This booking was already made" if repeated else "Booked"
    if repeated and r.status != "confirmed":
        what = "This booking was made earlier and has since been cancelled"
    view["message"] = (
        f"{what}: {view['room_type']} for {r.guest_name}, {view['dates']}, {counted(r.guests, 'guest')}, "
        f"{view['total']} including tax. The confirmation code is {view['confirmation_code_spoken']}."
    )
    return view


def found(r: Reservation, rooms: dict[str, RoomType], policy: HotelPolicy, today: date) -> dict[str, Any]:
    view = reservation_view(r, rooms, policy, today)
    if r.status == "cancelled":
        view["message"] = f"Reservation {view['confirmation_code_spoken']} was cancelled."
    else:
        view["message"] = (
            f"Found it: {view['room_type']} for {r.guest_name}, {view['dates']}, "
            f"{view['total']} including tax. {view['cancellation']}"
        )
    return view


def fee_required(
    r: Reservation, fee: int, rooms: dict[str, RoomType], policy: HotelPolicy, today: date
) -> dict[str, Any]:
    """A cancellation that costs `fee` cents, not made until the caller accepts it."""
    view = reservation_view(r, rooms, policy, today)
    view["status"] = "fee_required"
    view["cancellation_fee"] = money(fee, policy.currency)
    view["message"] = (
        f"Not cancelled yet: cancelling within {policy.free_cancel_days} days of arrival costs "
        f"{money(fee, policy.currency)}. Ask the caller whether to go ahead; "
        "if they agree, call again with accept_fee true."
    )
    return view


def cancelled(
    r: Reservation, fee: int, rooms: dict[str, RoomType], policy: HotelPolicy, today: date
) -> dict[str, Any]:
    view = reservation_view(r, rooms, policy, today)
    charge = f"A cancellation fee of {money(fee, policy.currency)} applies." if fee else "There is no charge."
    view["message"] = f"Reservation {view['confirmation_code_spoken']} is cancelled. {charge}"
    return view


def unchanged(r: Reservation, rooms: dict[str, RoomType], policy: HotelPolicy, today: date) -> dict[str, Any]:
    view = reservation_view(r, rooms, policy, today)
    view["message"] = "That is already how the reservation stands; nothing changed."
    return view


def changed(
    before: Reservation, after: Reservation, rooms: dict[str, RoomType], policy: HotelPolicy, today: date
) -> dict[str, Any]:
    view = reservation_view(after, rooms, policy, today)
    diff = after.total_cents - before.total_cents
    if diff > 0:
        delta = f"{money(diff, policy.currency)} more than before"
    elif diff < 0:
        delta = f"{money(-diff, policy.currency)} less than before"
    else:
        delta = "the same as before"
    view["message"] = (
        f"Changed: {view['room_type']}, {view['dates']}, {counted(after.guests, 'guest')}. "
        f"The new total is {view['total']} including tax, {delta}. The confirmation code stays the same."
    )
    return view


# --- the text of an answer ---------------------------------------------------------------------------

# Bounds of an answer the model reads: JSON nests once per level, and both json.dumps and json.loads recurse
# once per level, so an answer nested thousands deep raises RecursionError where it is written or read.
RESULT_MAX_DEPTH = 32
RESULT_MAX_PARTS = 10_000  # values, lists and objects in all, keys not counted
# a JSON string (escapes included) or one bracket: what the depth of an answer given as text is read from
_JSON_PART = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _shape_problem(value: object) -> str | None:
    """Why `value` (an answer's object, or its JSON text) is too deep or too large to write, or None. Walks
    without recursing, and stops at the first level or part past the bounds."""
    if isinstance(value, str):
        if value.count("[") + value.count("{") <= RESULT_MAX_DEPTH:
            return None
        depth = 0
        for m in _JSON_PART.finditer(value):
            part = m.group()
            if part in ("[", "{"):
                depth += 1
                if depth > RESULT_MAX_DEPTH:
                    return f"it is nested more than {RESULT_MAX_DEPTH} levels deep"
            elif part in ("]", "}"):
                depth -= 1
        return None
    stack: list[tuple[object, int]] = [(value, 0)]
    parts = 0
    while stack:
        node, depth = stack.pop()
        parts += 1
        if parts > RESULT_MAX_PARTS:
            return f"it has more than {RESULT_MAX_PARTS:,} parts"
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth >= RESULT_MAX_DEPTH:
            return f"it is nested more than {RESULT_MAX_DEPTH} levels deep"
        stack.extend((child, depth + 1) for child in children)
    return None


class ResultWriter:
    """Writes a tool's answer as the JSON text the model reads. An answer nested deeper than
    RESULT_MAX_DEPTH, larger than RESULT_MAX_PARTS or not JSON at all is refused before it is written (or
    handed on as text, to be parsed where it arrives) with a `HotelError` whose message the model reads in
    place of the answer, and counted in `stats()`. One per process or per caller; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = {"written": 0, "refused": 0}

    def stats(self) -> dict[str, int]:
        """Answers written, and answers refused, since this writer was made."""
        with self._lock:
            return dict(self._stats)

    def text(self, result: Mapping[str, Any] | str) -> str:
        """`result` as JSON text (text is kept as it is once its depth is checked); `HotelError` when it
        cannot be written."""
        problem = _shape_problem(result)
        text = ""
        if problem is None:
            try:
                text = result if isinstance(result, str) else json.dumps(result)
            except (TypeError, ValueError):  # a value JSON has no form for
                problem = "it holds a value that has no JSON form"
        with self._lock:
            self._stats["written" if problem is None else "refused"] += 1
        if problem is not None:
            raise HotelError(
                f"The tool's answer could not be read: {problem}. Tell the caller this cannot be looked up "
                "right now."
            )
        return text
