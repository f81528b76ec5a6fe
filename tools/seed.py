"""Seed data: one hotel with its room types, nightly rates and inventory, policies and FAQ, and `seed`, which
writes it and can run again. Knows the records the store takes; not the SQL or the hotel's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, timedelta

from .store import FaqEntry, HotelPolicy, Night, RoomType, Store, Tx


@dataclass(frozen=True)
class RoomSeed:
    room: RoomType
    rooms: int  # how many rooms of this type the hotel has
    weekday_cents: int  # Sunday to Thursday nights
    weekend_cents: int  # Friday and Saturday nights

    def rate(self, night: date) -> int:
        return self.weekend_cents if night.weekday() in (4, 5) else self.weekday_cents


@dataclass(frozen=True)
class HotelSeed:
    policy: HotelPolicy
    rooms: tuple[RoomSeed, ...]
    faq: tuple[FaqEntry, ...] = field(default=())


DEFAULT_HOTEL = HotelSeed(
    policy=HotelPolicy(
        name="The Larkspur Hotel",
        timezone="America/New_York",
        currency="USD",
        tax_rate_bp=1475,
        free_cancel_days=2,
        late_cancel_fee_nights=1,
        max_nights=30,
        booking_horizon_days=365,
        check_in_time="3 PM",
        check_out_time="11 AM",
    ),
    rooms=(
        RoomSeed(
            RoomType("standard_queen", "Standard Queen", "one queen bed, city view.", 2, 1),
            rooms=12,
            weekday_cents=14900,
            weekend_cents=17900,
        ),
        RoomSeed(
            RoomType("deluxe_king", "Deluxe King", "one king bed, harbor view and a sofa.", 2, 2),
            rooms=8,
            weekday_cents=20900,
            weekend_cents=24900,
        ),
        RoomSeed(
            RoomType(
                "family_suite", "Family Suite", "a king bed and two twin beds in a separate room.", 4, 3
            ),
            rooms=4,
            weekday_cents=32900,
            weekend_cents=37900,
        ),
    ),
    faq=(
        FaqEntry(
            "breakfast",
            "breakfast morning food buffet eat meal included",
            "Breakfast is served in the Garden Room from 6:30 to 10:30 on weekdays and 7 to 11 on weekends; "
            "it is $22 per adult and free for children under 12.",
        ),
        FaqEntry(
            "parking",
            "parking park car garage valet vehicle",
            "We have valet parking at $38 per night and a public garage across the street at $25 per day.",
        ),
        FaqEntry(
            "wifi",
            "wifi wi-fi internet wireless network password",
            "Wi-Fi is free in every room and public area; the network name is Larkspur Guest.",
        ),
        FaqEntry(
            "pets",
            "pet pets dog dogs cat animal",
            "Dogs up to 40 pounds are welcome for a $50 fee per stay; service animals are always welcome.",
        ),
        FaqEntry(
            "pool and gym",
            "pool gym fitness swim swimming exercise spa",
            "The indoor pool and the gym are open from 6 AM to 10 PM.",
        ),
        FaqEntry(
            "restaurant",
            "restaurant dinner lunch bar food dining hours",
            "The Larkspur Grill serves lunch from 11:30 to 2:30 and dinner from 5:30 to 10; "
            "the bar is open until midnight.",
        ),
        FaqEntry(
            "airport shuttle",
            "airport shuttle transport taxi bus transfer",
            "A shuttle runs to the airport every hour from 5 AM to 11 PM for $15 per person.",
        ),
        FaqEntry(
            "front desk", "front desk reception hours open staff", "The front desk is open 24 hours a day."
        ),
        FaqEntry(
            "accessibility",
            "accessible accessibility wheelchair disabled elevator",
            "Every floor is reachable by elevator, and each room type has wheelchair-accessible rooms.",
        ),
    ),
)


def seed(store: Store, today: date, data: HotelSeed = DEFAULT_HOTEL) -> int:
    """Write the hotel; returns how many inventory nights were added. It can run again: it updates the hotel,
    room types and FAQ, and adds inventory nights that are missing up to the booking horizon, never touching
    nights that already exist (so bookings survive a re-seed). Tests pass their own `HotelSeed` (for example
    one room of a kind)."""

    def run(tx: Tx) -> int:
        tx.put_hotel(data.policy)
        for room in data.rooms:
            tx.put_room_type(room.room)
        for entry in data.faq:
            tx.put_faq(entry)
        # Nights up to the last check-out a booking made today could have.
        days = data.policy.booking_horizon_days + data.policy.max_nights
        existing = {(n.room_type, n.night) for n in tx.nights([(None, today, today + timedelta(days=days))])}
        missing = [
            Night(room.room.code, night, room.rooms, 0, room.rate(night))
            for night in (today + timedelta(days=d) for d in range(days))
            for room in data.rooms
            if (room.room.code, night) not in existing
        ]
        tx.put_nights(missing)
        return len(missing)

    return store.transact(run, write=True)
