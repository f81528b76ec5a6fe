"""The hotel's operations behind the five tools: availability, booking, lookup, change/cancel, FAQ.

`Hotel.call(name, arguments)` validates the model's arguments, runs the operation in one database
transaction and returns a JSON-ready dict whose `message` can be spoken. Failures raise `HotelError`
subclasses with a spoken message; a database that stops answering or loses its connection becomes `Busy`
(nothing was changed) or `Unconfirmed` (a change was sent and its outcome could not be told), answered
by the call's deadline. Synchronous and thread-safe (the agent runs it off its event loop).
Knows the rules and the store; nothing about audio, LiveKit or the engine.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any

from . import faq, replies, rules, schemas
from .errors import HotelError, InvalidRequest, NotAllowed, NotFound, SoldOut
from .rules import Stay, money
from .store import HotelPolicy, Reservation, RoomType, Store, Tx

log = logging.getLogger(__name__)

NOT_FOUND = (
    "I couldn't find a reservation with that confirmation code and last name. "
    "Could you read me the code again, one character at a time?"
)
# How long one tool call may take, from its start to its answer, in seconds. The engine stops waiting for
# a tool after `tool_timeout_s` (15 s, engine/engine.py) and tells the model that the tool did not
# answer, so the hotel answers well before that, and nothing it was asked to do commits after it answered:
#   7.5 s  the call's transactions: every statement, the one retry on a fresh connection after a lost one
#          and the retries after lock conflicts. The server ends a statement 0.25 s before this
#          (`statement_timeout`), a row-lock wait after at most 2 s (`lock_timeout`, then retried), and
#          the client cuts a connection that has not answered by then (a stopped server answers nothing);
#   1.5 s  settling a COMMIT whose answer was lost: one query on another connection (`store.base.SETTLE_S`);
#   9 s    in all, which leaves 6 s for the agent's hand-off to its worker thread and the answer's way
#          back to the engine. The agent starts the clock when the model's call reaches it.
CALL_DEADLINE_S = 9.0
KEY_REUSED = (
    "This request key was already used for a booking with other details; a different booking needs a new key."
)


class NotSetUp(HotelError):
    code = "not_set_up"

    def __init__(self) -> None:
        super().__init__("The reservation system is not available right now; the front desk can help.")


class Hotel:
    """The hotel's operations on one store. `today` fixes the date (tests); by default it is the date
    in the hotel's time zone. Each operation answers within `deadline_s` of its start, or by the `deadline`
    it is given (a time.monotonic() value)."""

    def __init__(
        self,
        store: Store,
        *,
        today: Callable[[], date] | None = None,
        deadline_s: float = CALL_DEADLINE_S,
    ):
        self.store = store
        self.deadline_s = deadline_s
        self._today = today
        self._timezone: str | None = None

    # --- shared --------------------------------------------------------------------------------------

    def _by(self, deadline: float | None) -> float:
        """The deadline of an operation that starts now."""
        return deadline if deadline is not None else time.monotonic() + self.deadline_s

    def today(self, *, deadline: float | None = None) -> date:
        """The hotel's local date (injectable for tests)."""
        if self._today is not None:
            return self._today()
        if self._timezone is None:
            self._timezone = self.store.transact(
                lambda tx: self._policy(tx).timezone, deadline=self._by(deadline)
            )
        try:
            from zoneinfo import ZoneInfo

            return datetime.now(ZoneInfo(self._timezone)).date()
        except Exception:  # no tz database: UTC is better than failing a call
            log.warning("hotel: unknown time zone %s, using UTC", self._timezone)
            return datetime.now(UTC).date()

    def policy(self, *, deadline: float | None = None) -> HotelPolicy:
        return self.store.transact(self._policy, deadline=self._by(deadline))

    @staticmethod
    def _policy(tx: Tx) -> HotelPolicy:
        policy = tx.hotel()
        if policy is None:
            log.error("hotel: the database has no hotel; run `python -m tools seed`")
            raise NotSetUp()
        return policy

    @staticmethod
    def _rooms(tx: Tx) -> dict[str, RoomType]:
        return {room.code: room for room in tx.room_types()}

    @staticmethod
    def _match_room(text: str, rooms: dict[str, RoomType]) -> RoomType:
        return rooms[rules.match_room_type(text, [(r.code, r.name) for r in rooms.values()])]

    def _stay(self, args: Any, policy: HotelPolicy, today: date) -> Stay:
        return rules.resolve_stay(
            args.check_in,
            args.check_out,
            args.nights,
            today,
            max_nights=policy.max_nights,
            horizon_days=policy.booking_horizon_days,
        )

    # --- entry point ---------------------------------------------------------------------------------

    def call(
        self, name: str, arguments: Any, *, session: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Run tool `name` on the model's raw `arguments`. `session` scopes the idempotency of
        bookings: the same booking asked twice in one conversation is made once. `deadline`
        (time.monotonic()) is when the answer is due; by default `deadline_s` from now."""
        deadline = self._by(deadline)
        args = schemas.parse_args(name, arguments)
        if isinstance(args, schemas.ManageReservation):  # the phone's one tool for the three steps
            args = args.step()
        if isinstance(args, schemas.CheckAvailability):
            result = self.check_availability(args, deadline=deadline)
        elif isinstance(args, schemas.BookRoom):
            result = self.book_room(args, session=session, deadline=deadline)
        elif isinstance(args, schemas.FindReservation):
            result = self.find_reservation(args, deadline=deadline)
        elif isinstance(args, schemas.ChangeOrCancelReservation):
            result = self.change_or_cancel_reservation(args, deadline=deadline)
        elif isinstance(args, schemas.HotelInfo):
            result = self.hotel_info(args, deadline=deadline)
        else:
            raise AssertionError(name)
        # The model reads the response token by token: the sentence to say comes first.
        return {"message": result.pop("message"), **result}

    # --- check availability --------------------------------------------------------------------------

    def check_availability(
        self, args: schemas.CheckAvailability | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args = schemas.parse_args("check_availability", args)
        deadline = self._by(deadline)
        today = self.today(deadline=deadline)

        def run(tx: Tx) -> dict[str, Any]:
            policy, rooms = self._policy(tx), self._rooms(tx)
            stay = self._stay(args, policy, today)
            wanted = self._match_room(args.room_type, rooms) if args.room_type else None
            options = replies.options(rooms, tx.nights([(None, stay.check_in, stay.check_out)]), stay)
            fitting = [o for o in options if o.room.max_guests >= args.guests]
            free = [o for o in fitting if o.rooms_left > 0]
            result: dict[str, Any] = {
                "check_in": stay.check_in.isoformat(),
                "check_out": stay.check_out.isoformat(),
                "dates": stay.spoken(today),
                "guests": args.guests,
                "available": [
                    {
                        "room_type": o.room.name,
                        "sleeps": o.room.max_guests,
                        "rooms_left": o.rooms_left,
                        "total": money(o.price(policy).total_cents, policy.currency),
                        "description": o.room.description,
                    }
                    for o in free
                ],
            }
            if wanted is not None:
                option = next(o for o in options if o.room.code == wanted.code)
                if wanted.max_guests < args.guests:
                    result["message"] = replies.too_many_guests(wanted, args.guests, rooms).message
                elif option.rooms_left == 0:
                    result["message"] = replies.sold_out(option, options, args.guests, policy).message
                else:
                    total = money(option.price(policy).total_cents, policy.currency)
                    result["message"] = (
                        f"Yes, a {wanted.name} is available {stay.spoken(today)}, for {total} including tax."
                    )
                return result
            if not fitting:
                result["message"] = replies.too_many_guests(
                    max(rooms.values(), key=lambda r: r.max_guests), args.guests, rooms
                ).message
            elif not free:
                result["message"] = f"We're fully booked {stay.spoken(today)}."
            else:
                offers = "; ".join(
                    f"{o.room.name}, {money(o.price(policy).total_cents, policy.currency)}" for o in free
                )
                result["message"] = f"Available {stay.spoken(today)}, totals including tax: {offers}."
            return result

        return self.store.transact(run, deadline=deadline)

    # --- book ----------------------------------------------------------------------------------------

    @staticmethod
    def _derived_key(session: str, args: schemas.BookRoom, room: RoomType, stay: Stay) -> str:
        parts = [
            session,
            args.guest_name.casefold(),
            args.contact,
            room.code,
            stay.check_in.isoformat(),
            stay.check_out.isoformat(),
            str(args.guests),
        ]
        return "s:" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()

    @staticmethod
    def _same_booking(r: Reservation, args: schemas.BookRoom, room: RoomType, stay: Stay) -> bool:
        return (r.guest_name.casefold(), r.contact, r.room_type, r.check_in, r.check_out, r.guests) == (
            args.guest_name.casefold(),
            args.contact,
            room.code,
            stay.check_in,
            stay.check_out,
            args.guests,
        )

    def book_room(
        self,
        args: schemas.BookRoom | Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        session: str | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Book one room. A repeated `idempotency_key` (or, with `session`, the same details again in
        the same session) returns the first booking instead of making another."""
        args = schemas.parse_args("book_room", args)
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 200:
            raise ValueError("idempotency_key must be 1 to 200 characters")
        deadline = self._by(deadline)
        today = self.today(deadline=deadline)

        def run(tx: Tx) -> tuple[Reservation, bool, dict[str, RoomType], HotelPolicy]:
            policy, rooms = self._policy(tx), self._rooms(tx)
            stay = self._stay(args, policy, today)
            room = self._match_room(args.room_type, rooms)
            key = idempotency_key or (self._derived_key(session, args, room, stay) if session else None)
            if args.guests > room.max_guests:
                raise replies.too_many_guests(room, args.guests, rooms)
            # the key is looked up only once the nights are locked: a concurrent request with the same key
            # holds them until it commits, and its booking is then visible here (READ COMMITTED sees rows
            # committed before each statement), so a retry is answered with that booking, never "sold out"
            rows = tx.nights([(room.code, stay.check_in, stay.check_out)], lock=True)
            if key is not None and (existing := tx.reservation_by_key(key)) is not None:
                if not self._same_booking(existing, args, room, stay):
                    raise InvalidRequest(KEY_REUSED)
                return existing, True, rooms, policy
            option = replies.Option(room, rows, stay)
            if option.rooms_left <= 0:
                everything = replies.options(rooms, tx.nights([(None, stay.check_in, stay.check_out)]), stay)
                raise replies.sold_out(option, everything, args.guests, policy)
            price = option.price(policy)
            if tx.add_booked(room.code, stay.check_in, stay.check_out, +1) != stay.nights:
                raise AssertionError("inventory rows changed under a lock")
            now = self.store.now()
            reservation = Reservation(
                code=rules.new_confirmation_code(),
                idempotency_key=key,
                status="confirmed",
                guest_name=args.guest_name,
                contact=args.contact,
                room_type=room.code,
                check_in=stay.check_in,
                check_out=stay.check_out,
                guests=args.guests,
                subtotal_cents=price.subtotal_cents,
                tax_cents=price.tax_cents,
                total_cents=price.total_cents,
                cancellation_fee_cents=0,
                created_at=now,
                updated_at=now,
            )
            tx.insert_reservation(reservation)
            return reservation, False, rooms, policy

        reservation, repeated, rooms, policy = self.store.transact(run, write=True, deadline=deadline)
        view = replies.reservation_view(reservation, rooms, policy, today)
        view["already_booked"] = repeated
        what = "This booking was already made" if repeated else "Booked"
        if repeated and reservation.status != "confirmed":
            what = "This booking was made earlier and has since been cancelled"
        view["message"] = (
            f"{what}: {view['room_type']} for {reservation.guest_name}, {view['dates']}, "
            f"{reservation.guests} guest{'s' if reservation.guests != 1 else ''}, "
            f"{view['total']} including tax. "
            f"The confirmation code is {view['confirmation_code_spoken']}."
        )
        if not repeated:
            log.info("hotel: booked %s", reservation.code)
        return view

    # --- find ----------------------------------------------------------------------------------------

    def _owned(self, tx: Tx, code: str, last_name: str, *, lock: bool) -> Reservation:
        reservation = tx.reservation(code, lock=lock)
        if reservation is None or not rules.surname_matches(reservation.guest_name, last_name):
            raise NotFound(NOT_FOUND)
        return reservation

    def find_reservation(
        self, args: schemas.FindReservation | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args = schemas.parse_args("find_reservation", args)
        deadline = self._by(deadline)
        today = self.today(deadline=deadline)

        def run(tx: Tx) -> dict[str, Any]:
            reservation = self._owned(tx, args.confirmation_code, args.last_name, lock=False)
            policy, rooms = self._policy(tx), self._rooms(tx)
            view = replies.reservation_view(reservation, rooms, policy, today)
            if reservation.status == "cancelled":
                view["message"] = f"Reservation {view['confirmation_code_spoken']} was cancelled."
            else:
                view["message"] = (
                    f"Found it: {view['room_type']} for {reservation.guest_name}, {view['dates']}, "
                    f"{view['total']} including tax. {view['cancellation']}"
                )
            return view

        return self.store.transact(run, deadline=deadline)

    # --- change or cancel ----------------------------------------------------------------------------

    def change_or_cancel_reservation(
        self, args: schemas.ChangeOrCancelReservation | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args = schemas.parse_args("change_or_cancel_reservation", args)
        deadline = self._by(deadline)
        today = self.today(deadline=deadline)

        def run(tx: Tx) -> dict[str, Any]:
            reservation = self._owned(tx, args.confirmation_code, args.last_name, lock=True)
            policy, rooms = self._policy(tx), self._rooms(tx)
            if reservation.status == "cancelled":
                raise NotAllowed("That reservation is already cancelled; I can make a new booking instead.")
            if reservation.check_in < today:
                raise NotAllowed("That stay has already started, so the front desk needs to make any change.")
            if args.action == "cancel":
                return self._cancel(tx, reservation, args.accept_fee, policy, rooms, today)
            return self._change(tx, reservation, args, policy, rooms, today)

        return self.store.transact(run, write=True, deadline=deadline)

    def _cancel(
        self,
        tx: Tx,
        r: Reservation,
        accept_fee: bool,
        policy: HotelPolicy,
        rooms: dict[str, RoomType],
        today: date,
    ) -> dict[str, Any]:
        fee = replies.cancellation_fee(r, policy, today)
        if fee > 0 and not accept_fee:
            view = replies.reservation_view(r, rooms, policy, today)
            view["status"] = "fee_required"
            view["cancellation_fee"] = money(fee, policy.currency)
            view["message"] = (
                f"Not cancelled yet: cancelling within {policy.free_cancel_days} days of arrival costs "
                f"{money(fee, policy.currency)}. Ask the caller whether to go ahead; "
                "if they agree, call again with accept_fee true."
            )
            return view
        tx.add_booked(r.room_type, r.check_in, r.check_out, -1)
        # Clearing the key lets the same guest book the same stay again after cancelling it.
        cancelled = r.but(
            status="cancelled", cancellation_fee_cents=fee, idempotency_key=None, updated_at=self.store.now()
        )
        tx.update_reservation(cancelled)
        log.info("hotel: cancelled %s", r.code)
        view = replies.reservation_view(cancelled, rooms, policy, today)
        charge = (
            f"A cancellation fee of {money(fee, policy.currency)} applies." if fee else "There is no charge."
        )
        view["message"] = f"Reservation {view['confirmation_code_spoken']} is cancelled. {charge}"
        return view

    def _change(
        self,
        tx: Tx,
        r: Reservation,
        args: schemas.ChangeOrCancelReservation,
        policy: HotelPolicy,
        rooms: dict[str, RoomType],
        today: date,
    ) -> dict[str, Any]:
        dates_given = any(v is not None for v in (args.check_in, args.check_out, args.nights))
        if not dates_given and args.room_type is None and args.guests is None:
            raise InvalidRequest("What should change: the dates, the room type or the number of guests?")
        stay = Stay(r.check_in, r.check_out)
        if dates_given:
            check_out, nights = args.check_out, args.nights
            if check_out is None and nights is None:
                if args.check_in is not None:
                    nights = r.nights  # a new arrival date keeps the length of the stay
                else:
                    check_out = r.check_out.isoformat()
            stay = rules.resolve_stay(
                args.check_in or r.check_in.isoformat(),
                check_out,
                nights,
                today,
                max_nights=policy.max_nights,
                horizon_days=policy.booking_horizon_days,
            )
        room = self._match_room(args.room_type, rooms) if args.room_type else rooms[r.room_type]
        guests = args.guests if args.guests is not None else r.guests
        if guests > room.max_guests:
            raise replies.too_many_guests(room, guests, rooms)
        moved = stay != Stay(r.check_in, r.check_out) or room.code != r.room_type
        if not moved and guests == r.guests:
            view = replies.reservation_view(r, rooms, policy, today)
            view["message"] = "That is already how the reservation stands; nothing changed."
            return view
        updated = r.but(guests=guests, updated_at=self.store.now())
        if moved:
            # Lock the old and the new nights together, in one order, then move the room.
            tx.nights(
                [(r.room_type, r.check_in, r.check_out), (room.code, stay.check_in, stay.check_out)],
                lock=True,
            )
            tx.add_booked(r.room_type, r.check_in, r.check_out, -1)
            option = replies.Option(room, tx.nights([(room.code, stay.check_in, stay.check_out)]), stay)
            if option.rooms_left <= 0:
                everything = replies.options(rooms, tx.nights([(None, stay.check_in, stay.check_out)]), stay)
                error = replies.sold_out(option, everything, guests, policy)
                raise SoldOut(error.message + " The reservation is unchanged.")
            tx.add_booked(room.code, stay.check_in, stay.check_out, +1)
            price = option.price(policy)
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
        view = replies.reservation_view(updated, rooms, policy, today)
        diff = updated.total_cents - r.total_cents
        if diff > 0:
            delta = f"{money(diff, policy.currency)} more than before"
        elif diff < 0:
            delta = f"{money(-diff, policy.currency)} less than before"
        else:
            delta = "the same as before"
        view["message"] = (
            f"Changed: {view['room_type']}, {view['dates']}, {guests} guest{'s' if guests != 1 else ''}. "
            f"The new total is {view['total']} including tax, {delta}. The confirmation code stays the same."
        )
        return view

    # --- hotel information ---------------------------------------------------------------------------

    def hotel_info(
        self, args: schemas.HotelInfo | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args = schemas.parse_args("hotel_info", args)

        def run(tx: Tx) -> dict[str, Any]:
            return faq.answer(args.topic, faq.entries(tx.faq(), self._policy(tx), tx.room_types()))

        return self.store.transact(run, deadline=self._by(deadline))

    # --- admin ---------------------------------------------------------------------------------------

    def reservations(self, *, status: str | None = None) -> list[Reservation]:
        return self.store.transact(lambda tx: tx.reservations(status=status))
