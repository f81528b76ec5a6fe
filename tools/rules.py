"""The hotel's rules as pure functions: dates as callers say them, stays, prices and cancellation fees in
integer cents, confirmation codes, room types, and how each is said. Every refusal is an `InvalidRequest` to
be spoken; knows the calendar, not the database, the model or LiveKit.
"""

from __future__ import annotations

import calendar
import re
import secrets
import unicodedata
from dataclasses import dataclass
from datetime import date, timedelta

from .errors import InvalidRequest

# --- caller text -------------------------------------------------------------------------------------


def clip(text: str, limit: int = 40) -> str:
    """A short, printable echo of caller-supplied text for an error message."""
    text = "".join(ch for ch in text if ch.isprintable())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def hidden_character(text: str) -> str | None:
    """The first character of `text` that does not print (a control or an invisible one), as `U+0000`: an
    echo cannot show it, so an error message names it instead; None when every character prints."""
    hidden = next((ch for ch in text if not ch.isprintable()), None)
    return None if hidden is None else f"U+{ord(hidden):04X}"


def counted(n: int, thing: str) -> str:
    """`1 night`, `3 guests`: a number with its noun as it is said."""
    return f"{n} {thing}{'s' if n != 1 else ''}"


# --- dates -------------------------------------------------------------------------------------------

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): i for i, name in enumerate(calendar.month_abbr) if name})
_MONTHS["sept"] = 9
_WEEKDAYS = {name.lower(): i for i, name in enumerate(calendar.day_name)}
_WEEKDAYS.update({name.lower(): i for i, name in enumerate(calendar.day_abbr)})
_ISO = re.compile(r"^(\d{4})-(\d{1,2})-(\d{1,2})$")
_ORDINAL = re.compile(r"\b(\d{1,2})(st|nd|rd|th)\b")


def _next_day_of_month(day: int, today: date) -> date | None:
    """The first date on or after `today` whose day of the month is `day`; None for a day no month has."""
    if not 1 <= day <= 31:
        return None
    year, month = today.year, today.month
    for _ in range(13):
        if day <= calendar.monthrange(year, month)[1]:
            candidate = date(year, month, day)
            if candidate >= today:
                return candidate
        month += 1
        if month == 13:
            year, month = year + 1, 1
    return None


def parse_date(text: str, today: date, *, not_before: date | None = None, field: str = "date") -> date:
    """A calendar date from what the model passed: ISO `2025-03-12`, or as a caller says it.

    Accepted spoken forms: today, tonight, tomorrow, the day after tomorrow, a weekday (`Friday`,
    `this Friday`: the first one on or after `not_before`; `next Friday`: the first one after
    today), a day of the month (`the 12th`) and a month with a day (`March 12`, `12 March`,
    `March 12th 2026`); without a year, the first such date on or after `not_before` (default today,
    a check-out passes the day after check-in).
    """
    raw = text
    anchor = not_before or today
    s = unicodedata.normalize("NFKC", text).strip().lower()
    if m := _ISO.match(s):
        try:
            return date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        except ValueError:
            raise InvalidRequest(f"The {field} {clip(raw)} does not exist on the calendar.") from None
    s = s.replace(",", " ").replace(".", " ")
    s = _ORDINAL.sub(r"\1", s)
    words = [w for w in s.split() if w not in ("the", "of", "on", "this", "coming")]
    if words in (["today"], ["tonight"]):
        return today
    if words == ["tomorrow"]:
        return today + timedelta(days=1)
    if words == ["day", "after", "tomorrow"]:
        return today + timedelta(days=2)
    if len(words) == 2 and words[0] == "next" and words[1] in _WEEKDAYS:
        return today + timedelta(days=(_WEEKDAYS[words[1]] - today.weekday() - 1) % 7 + 1)
    if len(words) == 1 and words[0] in _WEEKDAYS:
        return anchor + timedelta(days=(_WEEKDAYS[words[0]] - anchor.weekday()) % 7)
    # isdecimal, not isdigit: int() takes every decimal digit (Arabic-Indic too) but no other "digit"
    # (Ethiopic numerals, circled numbers)
    if len(words) == 1 and words[0].isdecimal():
        found = _next_day_of_month(int(words[0]), anchor)
        if found is None:
            raise InvalidRequest(f"The {field} {clip(raw)} does not exist on the calendar.")
        return found
    numbers = [w for w in words if w.isdecimal()]
    names = [w for w in words if not w.isdecimal()]
    if len(names) == 1 and names[0] in _MONTHS and 1 <= len(numbers) <= 2:
        month, day = _MONTHS[names[0]], int(numbers[0])
        years = [int(numbers[1])] if len(numbers) == 2 else range(anchor.year, anchor.year + 9)
        for year in years:
            try:
                candidate = date(year, month, day)
            except (ValueError, OverflowError):
                continue  # no such day that year (February 29th, the 99999999999th): try the next one
            if candidate >= anchor or len(numbers) == 2:
                return candidate
        raise InvalidRequest(f"The {field} {clip(raw)} does not exist on the calendar.")
    raise InvalidRequest(
        f"I could not read the {field} {clip(raw)!r}. Give it as year-month-day, for example "
        f"{(today + timedelta(days=7)).isoformat()}."
    )


def day_ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def spoken_date(d: date, today: date | None = None) -> str:
    """`Friday, March 12` (the year is added when it is not the current one)."""
    text = f"{calendar.day_name[d.weekday()]}, {calendar.month_name[d.month]} {d.day}"
    if today is None or d.year != today.year:
        text += f", {d.year}"
    return text


def spoken_night(d: date) -> str:
    """`Friday the 12th`: how a single night is named in a sold-out answer."""
    return f"{calendar.day_name[d.weekday()]} the {day_ordinal(d.day)}"


@dataclass(frozen=True)
class Stay:
    check_in: date
    check_out: date

    @property
    def nights(self) -> int:
        return (self.check_out - self.check_in).days

    def night_dates(self) -> list[date]:
        return [self.check_in + timedelta(days=i) for i in range(self.nights)]

    def spoken(self, today: date | None = None) -> str:
        return (
            f"{spoken_date(self.check_in, today)} to {spoken_date(self.check_out, today)}, "
            f"{counted(self.nights, 'night')}"
        )


def resolve_stay(
    check_in: str,
    check_out: str | None,
    nights: int | None,
    today: date,
    *,
    max_nights: int,
    horizon_days: int,
) -> Stay:
    """Validate a stay: not in the past, check-out after check-in, at most `max_nights`, within the
    booking horizon. Exactly one of `check_out` and `nights` is needed (both must then agree)."""
    start = parse_date(check_in, today, field="check-in date")
    if start < today:
        raise InvalidRequest(
            f"The check-in date, {spoken_date(start, today)}, is in the past; today is "
            f"{spoken_date(today, today)}."
        )
    last_bookable = today + timedelta(days=horizon_days)
    if start > last_bookable:
        raise InvalidRequest(
            f"We take bookings up to {horizon_days} days ahead, so the latest check-in is "
            f"{spoken_date(last_bookable, today)}."
        )
    if check_out is None and nights is None:
        raise InvalidRequest("I still need the check-out date or the number of nights.")
    end = (
        parse_date(check_out, today, not_before=start + timedelta(days=1), field="check-out date")
        if check_out is not None
        else None
    )
    if nights is not None:
        if nights < 1:
            raise InvalidRequest("A stay is at least one night.")
        by_nights = start + timedelta(days=nights)
        if end is not None and end != by_nights:
            raise InvalidRequest(
                f"{counted(nights, 'night')} from {spoken_date(start, today)} "
                f"ends on {spoken_date(by_nights, today)}, not {spoken_date(end, today)}; which one is right?"
            )
        end = by_nights
    assert end is not None
    if end <= start:
        raise InvalidRequest("The check-out date must be after the check-in date.")
    stay = Stay(start, end)
    if stay.nights > max_nights:
        raise InvalidRequest(
            f"We can book stays of up to {max_nights} nights; for a longer stay the front desk can help."
        )
    return stay


# --- money -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    subtotal_cents: int
    tax_cents: int

    @property
    def total_cents(self) -> int:
        return self.subtotal_cents + self.tax_cents


def price_stay(nightly_rates_cents: list[int], tax_rate_bp: int) -> Price:
    """Sum of the nightly rates plus tax in basis points, rounded half up to the cent."""
    subtotal = sum(nightly_rates_cents)
    tax = (subtotal * tax_rate_bp + 5_000) // 10_000
    return Price(subtotal, tax)


def money(cents: int, currency: str = "USD") -> str:
    """`$412.32`, or `$412` for whole amounts (easier to say)."""
    symbol = {"USD": "$", "EUR": "€", "GBP": "£"}.get(currency, "")
    sign = "-" if cents < 0 else ""
    whole, part = divmod(abs(cents), 100)
    text = f"{whole:,}" if part == 0 else f"{whole:,}.{part:02d}"
    return f"{sign}{symbol}{text}" if symbol else f"{sign}{text} {currency}"


def cancellation_fee_cents(
    total_cents: int, nights: int, check_in: date, today: date, *, free_days: int, fee_nights: int
) -> int:
    """Free until `free_days` days before arrival; after that `fee_nights` nights' share of the total."""
    if (check_in - today).days >= free_days:
        return 0
    return total_cents * min(fee_nights, nights) // nights


def free_cancellation_until(check_in: date, free_days: int) -> date:
    """The last day on which cancelling is free."""
    return check_in - timedelta(days=free_days)


# --- confirmation codes ------------------------------------------------------------------------------

# No 0/O, 1/I/L, 2/Z, 5/S, 8/B, 6/G, Q: characters a phone line or a listener easily confuses.
CODE_ALPHABET = "ACDEFHJKMNPRTUVWXY3479"
CODE_LENGTH = 8


def new_confirmation_code() -> str:
    """8 characters from a 22-letter alphabet, drawn by the OS's CSPRNG: about 36 bits, and a lookup
    also needs the guest's surname."""
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def normalize_code(text: str) -> str:
    """Codes are read aloud: accept spaces, dashes and lower case."""
    return "".join(ch for ch in text.upper() if ch.isalnum())


def spoken_code(code: str) -> str:
    """`K 7 M 4, Q X 9 P`: one character at a time, in two groups."""
    half = len(code) // 2
    return f"{' '.join(code[:half])}, {' '.join(code[half:])}"


# --- room types --------------------------------------------------------------------------------------


def _room_words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.casefold()).split()


def match_room_type(wanted: str, room_types: list[tuple[str, str]]) -> str:
    """The code of the room type the caller means, given (code, name) pairs.

    Exact code or name first, then the only type whose words include every word said
    (`deluxe` -> `deluxe_king`). Raises `InvalidRequest` naming the real choices otherwise.
    """
    words = [w for w in _room_words(wanted) if w not in ("room", "rooms", "a", "the")]
    choices = ", ".join(name for _, name in room_types)
    if not words:
        raise InvalidRequest(f"Which room type? We have {choices}.")
    key = " ".join(words)
    for code, name in room_types:
        if key in (" ".join(_room_words(code)), " ".join(_room_words(name))):
            return code
    hits = [
        code
        for code, name in room_types
        if all(w in set(_room_words(code)) | set(_room_words(name)) for w in words)
    ]
    if len(hits) == 1:
        return hits[0]
    if hits:
        names = ", ".join(name for code, name in room_types if code in hits)
        raise InvalidRequest(f"Several rooms match {clip(wanted)!r}: {names}. Which one?")
    raise InvalidRequest(f"We have no {clip(wanted)!r} rooms. We have {choices}.")
