"""Plain records the store reads and writes, the same on SQLite and PostgreSQL, and the reading of dates
and times a backend hands back as text. Knows nothing of SQL or of the hotel's rules."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, date, datetime


def as_date(value: date | str) -> date:
    if isinstance(value, datetime):
        return value.date()
    return value if isinstance(value, date) else date.fromisoformat(value)


def as_datetime(value: datetime | str) -> datetime:
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class HotelPolicy:
    name: str
    timezone: str
    currency: str
    tax_rate_bp: int  # basis points: 1475 = 14.75 %
    free_cancel_days: int  # cancelling this many days or more before arrival is free
    late_cancel_fee_nights: int  # later than that costs this many nights' share of the total
    max_nights: int
    booking_horizon_days: int
    check_in_time: str
    check_out_time: str


@dataclass(frozen=True)
class RoomType:
    code: str
    name: str
    description: str
    max_guests: int
    sort_order: int = 0


@dataclass(frozen=True)
class Night:
    """One inventory row: rooms of one type for one night."""

    room_type: str
    night: date
    total: int
    booked: int
    rate_cents: int

    @property
    def free(self) -> int:
        return self.total - self.booked


@dataclass(frozen=True)
class Reservation:
    code: str
    idempotency_key: str | None
    status: str  # confirmed | cancelled
    guest_name: str
    contact: str
    room_type: str
    check_in: date
    check_out: date
    guests: int
    subtotal_cents: int
    tax_cents: int
    total_cents: int
    cancellation_fee_cents: int
    created_at: datetime
    updated_at: datetime

    @property
    def nights(self) -> int:
        return (self.check_out - self.check_in).days

    def but(self, **changes: object) -> Reservation:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FaqEntry:
    topic: str
    keywords: str  # space-separated words that also point at this entry
    answer: str
