"""What a reservation does to the inventory inside the caller's transaction: a room taken for a new stay,
moved for a changed one, given back on a cancellation, each priced (a late cancellation's fee quoted before
it is charged). Knows the rules, the records and `Tx`; not deadlines, sessions or how the call arrived.
"""

from __future__ import annotations

import logging
from datetime import date, datetime
from typing import Any

from . import replies, schemas, stays
from .errors import InvalidRequest
from .rules import Price, Stay
from .store import HotelPolicy, Night, Reservation, RoomType, Tx

log = logging.getLogger(__name__)


def take_room(
    tx: Tx,
    room: RoomType,
    stay: Stay,
    rows: list[Night],
    guests: int,
    rooms: dict[str, RoomType],
    policy: HotelPolicy,
    *,
    changing: bool = False,
) -> Price:
    """Book one room of `room`'s type on every night of `stay`, whose inventory `rows` the caller has locked,
    and return its price; `SoldOut`, naming another type that is free for the stay, when a night has none."""
    option = stays.Option(room, rows, stay)
    if option.rooms_left <= 0:
        everything = stays.options(rooms, tx.nights([(None, stay.check_in, stay.check_out)]), stay)
        raise replies.sold_out(option, everything, guests, policy, changing=changing)
    if tx.add_booked(room.code, stay.check_in, stay.check_out, +1) != stay.nights:
        raise AssertionError("inventory rows changed under a lock")
    return option.price(policy)


def cancel(
    tx: Tx,
    r: Reservation,
    accept_fee: bool,
    policy: HotelPolicy,
    rooms: dict[str, RoomType],
    today: date,
    now: datetime,
) -> dict[str, Any]:
    """Cancel `r`, unless it costs a fee the caller has not accepted yet: then the fee is quoted."""
    fee = stays.cancellation_fee(r, policy, today)
    if fee > 0 and not accept_fee:
        return replies.fee_required(r, fee, rooms, policy, today)
    tx.add_booked(r.room_type, r.check_in, r.check_out, -1)
    # Clearing the key lets the same guest book the same stay again after cancelling it.
    done = r.but(status="cancelled", cancellation_fee_cents=fee, idempotency_key=None, updated_at=now)
    tx.update_reservation(done)
    log.info("hotel: cancelled %s", r.code)
    return replies.cancelled(done, fee, rooms, policy, today)


def change(
    tx: Tx,
    r: Reservation,
    args: schemas.ChangeOrCancelReservation,
    policy: HotelPolicy,
    rooms: dict[str, RoomType],
    today: date,
    now: datetime,
) -> dict[str, Any]:
    """Change `r`'s dates, room type or guests as `args` say; a stay or room that moves takes its new
    nights' rooms and price, or is refused whole when one of them is sold out."""
    dates_given = any(v is not None for v in (args.check_in, args.check_out, args.nights))
    if not dates_given and args.room_type is None and args.guests is None:
        raise InvalidRequest(replies.WHAT_TO_CHANGE)
    stay = Stay(r.check_in, r.check_out)
    if dates_given:
        check_out, nights = args.check_out, args.nights
        if check_out is None and nights is None:
            if args.check_in is not None:
                nights = r.nights  # a new arrival date keeps the length of the stay
            else:
                check_out = r.check_out.isoformat()
        stay = stays.resolve(args.check_in or r.check_in.isoformat(), check_out, nights, policy, today)
    room = stays.match_room(args.room_type, rooms) if args.room_type else rooms[r.room_type]
    guests = args.guests if args.guests is not None else r.guests
    if guests > room.max_guests:
        raise replies.too_many_guests(room, guests, rooms)
    moved = stay != Stay(r.check_in, r.check_out) or room.code != r.room_type
    if not moved and guests == r.guests:
        return replies.unchanged(r, rooms, policy, today)
    updated = r.but(guests=guests, updated_at=now)
    if moved:
        # Lock the old and the new nights together, in one order, then move the room.
        tx.nights(
            [(r.room_type, r.check_in, r.check_out), (room.code, stay.check_in, stay.check_out)],
            lock=True,
        )
        tx.add_booked(r.room_type, r.check_in, r.check_out, -1)
        rows = tx.nights([(room.code, stay.check_in, stay.check_out)])
        price = take_room(tx, room, stay, rows, guests, rooms, policy, changing=True)
        updated = updated.but(
            room_type=room.code,
            check_in=stay.check_in,
            check_out=stay.check_out,
            subtotal_cents=price.subtotal_cents,
            tax_cents=price.tax_cents,
            total_cents=price.total_cents,
        )
    tx.update_reservation(updated)
    log.info("hotel: changed %s", r.code)
    return replies.changed(r, updated, rooms, policy, today)
