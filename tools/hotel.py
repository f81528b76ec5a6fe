"""The hotel's operations behind the tools: `Hotel.call(name, arguments)` validates the model's arguments,
runs the operation in one transaction answered by the call's deadline, and returns a JSON-ready dict whose
`message` can be spoken. Knows the rules and the store; nothing about audio, LiveKit or the engine.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any

from . import bookings, faq, guests, replies, rules, schemas, stays
from .errors import InvalidRequest, NotAllowed, NotFound, NotSetUp
from .rules import Stay
from .store import HotelPolicy, Reservation, RoomType, Store, Tx

log = logging.getLogger(__name__)

# How long one tool call may take, from its start to its answer, in seconds. The engine stops waiting for
# a tool after `tool_timeout_s` (15 s, engine/config/engine_config.py) and tells the model that the tool did
# not answer, so the hotel answers well before that, and nothing it was asked to do commits after it answered:
#   7.5 s  the call's transactions: every statement, the one retry on a fresh connection after a lost one
#          and the retries after lock conflicts. The server ends a statement 0.25 s before this
#          (`statement_timeout`), a row-lock wait after at most 2 s (`lock_timeout`, then retried), and
#          the client cuts a connection that has not answered by then (a stopped server answers nothing);
#   1.5 s  settling a COMMIT whose answer was lost: one query on another connection (`store.base.SETTLE_S`);
#   9 s    in all, which leaves 6 s for the agent's hand-off to its worker thread and the answer's way
#          back to the engine. The agent starts the clock when the model's call reaches it.
CALL_DEADLINE_S = 9.0


class Hotel:
    """The hotel's operations on one store. `today` fixes the date (tests); by default it is the date
    in the hotel's time zone. Each operation answers within `deadline_s` of its start, or by the `deadline`
    it is given (a time.monotonic() value). Failures raise `HotelError` subclasses with a spoken message; a
    database that stops answering or loses its connection becomes `Busy` (nothing was changed) or
    `Unconfirmed` (a change was sent and its outcome could not be told). Synchronous and thread-safe (the
    agent runs it off its event loop)."""

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
        except Exception:  # noqa: BLE001 (no tz database: UTC is better than failing a call)
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

    def _begin(self, name: str, args: Any, deadline: float | None) -> tuple[Any, float, date]:
        """A tool's start: its arguments parsed (InvalidRequest otherwise), its deadline, the day it is."""
        deadline = self._by(deadline)
        return schemas.parse_args(name, args), deadline, self.today(deadline=deadline)

    # --- check availability --------------------------------------------------------------------------

    def check_availability(
        self, args: schemas.CheckAvailability | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args, deadline, today = self._begin("check_availability", args, deadline)

        def run(tx: Tx) -> dict[str, Any]:
            policy, rooms = self._policy(tx), self._rooms(tx)
            stay = stays.resolve(args.check_in, args.check_out, args.nights, policy, today)
            wanted = stays.match_room(args.room_type, rooms) if args.room_type else None
            options = stays.options(rooms, tx.nights([(None, stay.check_in, stay.check_out)]), stay)
            return replies.availability(stay, options, wanted, args.guests, rooms, policy, today)

        return self.store.transact(run, deadline=deadline)

    # --- book ----------------------------------------------------------------------------------------

    # A booking is the same booking under any spelling of the name that looks the same (`guests.name_key`):
    # a stay booked again with a Cyrillic letter for the Latin one it looks like, or in fullwidth letters, is
    # found, not booked twice.
    @staticmethod
    def _derived_key(session: str, args: schemas.BookRoom, room: RoomType, stay: Stay) -> str:
        parts = [
            session,
            guests.name_key(args.guest_name),
            args.contact,
            room.code,
            stay.check_in.isoformat(),
            stay.check_out.isoformat(),
            str(args.guests),
        ]
        return "s:" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()

    @staticmethod
    def _same_booking(r: Reservation, args: schemas.BookRoom, room: RoomType, stay: Stay) -> bool:
        return (guests.name_key(r.guest_name), r.contact, r.room_type, r.check_in, r.check_out, r.guests) == (
            guests.name_key(args.guest_name),
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
            stay = stays.resolve(args.check_in, args.check_out, args.nights, policy, today)
            room = stays.match_room(args.room_type, rooms)
            key = idempotency_key or (self._derived_key(session, args, room, stay) if session else None)
            if args.guests > room.max_guests:
                raise replies.too_many_guests(room, args.guests, rooms)
            # the key is looked up only once the nights are locked: a concurrent request with the same key
            # holds them until it commits, and its booking is then visible here (READ COMMITTED sees rows
            # committed before each statement), so a retry is answered with that booking, never "sold out"
            rows = tx.nights([(room.code, stay.check_in, stay.check_out)], lock=True)
            if key is not None and (existing := tx.reservation_by_key(key)) is not None:
                if not self._same_booking(existing, args, room, stay):
                    raise InvalidRequest(replies.KEY_REUSED)
                return existing, True, rooms, policy
            price = bookings.take_room(tx, room, stay, rows, args.guests, rooms, policy)
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
        if not repeated:
            log.info("hotel: booked %s", reservation.code)
        return replies.booked(reservation, repeated, rooms, policy, today)

    # --- find ----------------------------------------------------------------------------------------

    def _owned(self, tx: Tx, code: str, last_name: str, *, lock: bool) -> Reservation:
        reservation = tx.reservation(code, lock=lock)
        if reservation is None or not guests.surname_matches(reservation.guest_name, last_name):
            raise NotFound(replies.NOT_FOUND)
        return reservation

    def find_reservation(
        self, args: schemas.FindReservation | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args, deadline, today = self._begin("find_reservation", args, deadline)

        def run(tx: Tx) -> dict[str, Any]:
            reservation = self._owned(tx, args.confirmation_code, args.last_name, lock=False)
            policy, rooms = self._policy(tx), self._rooms(tx)
            return replies.found(reservation, rooms, policy, today)

        return self.store.transact(run, deadline=deadline)

    # --- change or cancel ----------------------------------------------------------------------------

    def change_or_cancel_reservation(
        self, args: schemas.ChangeOrCancelReservation | Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        args, deadline, today = self._begin("change_or_cancel_reservation", args, deadline)

        def run(tx: Tx) -> dict[str, Any]:
            reservation = self._owned(tx, args.confirmation_code, args.last_name, lock=True)
            policy, rooms = self._policy(tx), self._rooms(tx)
            if reservation.status == "cancelled":
                raise NotAllowed(replies.ALREADY_CANCELLED)
            if reservation.check_in < today:
                raise NotAllowed(replies.ALREADY_STARTED)
            now = self.store.now()
            if args.action == "cancel":
                return bookings.cancel(tx, reservation, args.accept_fee, policy, rooms, today, now)
            return bookings.change(tx, reservation, args, policy, rooms, today, now)

        return self.store.transact(run, write=True, deadline=deadline)

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
