"""Hostile arguments from the model: SQL fragments, huge strings, emoji, negative or absurd numbers,
impossible dates, wrong types. Each must come back as a short sentence the model can read, with no
crash, no echo of the payload, no injection and no change to the database."""

from __future__ import annotations

import pytest

import hotel_support
from hotel_support import booking
from tools import schemas
from tools.audit import audit
from tools.errors import HotelError, InvalidRequest, NotFound

HUGE = "A" * 10_000
SQL = "Robert'); DROP TABLE reservations;--"


@pytest.fixture(scope="module", params=hotel_support.BACKENDS)
def store(request, tmp_path_factory):
    # One store per backend for the module: every test asserts it left the database unchanged.
    with hotel_support.seeded_store(request.param, tmp_path_factory.mktemp(request.param)) as s:
        yield s


def snapshot(store) -> tuple:
    def read(tx):
        tables = [
            tx._rows(f"SELECT COUNT(*) FROM {t}")[0][0]
            for t in ("hotel", "room_types", "inventory", "reservations", "faq")
        ]
        return (
            tuple(tables),
            tuple(tx.reservations()),
            tuple(
                n.booked
                for n in tx.nights([(None, hotel_support.TODAY, hotel_support.TODAY.replace(year=2031))])
            ),
        )

    return store.transact(read)


BAD_BOOKINGS = {
    "sql in the name": booking(guest_name=SQL),
    "sql in the room type": booking(room_type="deluxe' OR '1'='1"),
    "sql in the contact": booking(contact="1; DELETE FROM inventory"),
    "sql in the date": booking(check_in="2030-03-12'; DROP TABLE inventory; --"),
    "10,000-character name": booking(guest_name=HUGE),
    "10,000-character room type": booking(room_type=HUGE),
    "10,000-character date": booking(check_in=HUGE),
    "emoji name": booking(guest_name="Ada 🏨🔥"),
    "emoji room": booking(room_type="🛏️"),
    "control characters": booking(guest_name="Ada\x00Lovelace\u202e"),
    "markup": booking(guest_name="<script>alert(1)</script>"),
    "negative guests": booking(guests=-2),
    "zero guests": booking(guests=0),
    "absurd guests": booking(guests=10**30),
    "guests as words": booking(guests="two"),
    "guests as a boolean": booking(guests=True),
    "fractional guests": booking(guests=2.5),
    "guests missing": {k: v for k, v in booking().items() if k != "guests"},
    "null name": booking(guest_name=None),
    "name as a number": booking(guest_name=12345),
    "name as a list": booking(guest_name=["Ada", "Lovelace"]),
    "dates as a number": booking(check_in=20300312),
    "dates as an object": booking(check_in={"year": 2030, "month": 3, "day": 12}),
    "February 30th": booking(check_in="2030-02-30"),
    "month 13": booking(check_in="2030-13-01"),
    "in the past": booking(check_in="2020-01-01", check_out="2020-01-03"),
    "check-out before check-in": booking(check_out="2030-03-10"),
    "check-out on check-in": booking(check_out="2030-03-12"),
    "31 nights": booking(check_out="2030-04-12"),
    "minus three nights": booking(nights=-3),
    "nights and check-out disagree": {**booking(), "nights": 5},
    "year 10000": booking(check_in="10000-01-01"),
    "unknown field": {**booking(), "discount": "100%"},
    "email with spaces": booking(contact="ada @ example . com"),
    "phone too short": booking(contact="123"),
}


@pytest.mark.parametrize("args", BAD_BOOKINGS.values(), ids=BAD_BOOKINGS.keys())
def test_hostile_bookings_are_refused_in_words(store, args):
    hotel = hotel_support.hotel(store)
    before = snapshot(store)
    with pytest.raises(InvalidRequest) as err:
        hotel.call("book_room", args, session="hostile")
    message = err.value.message
    assert 10 < len(message) < 400, message
    assert HUGE[:100] not in message and "Traceback" not in message  # an echo is clipped to 40 characters
    assert message.isprintable()
    assert snapshot(store) == before


@pytest.mark.parametrize(("name", "hidden"), [("book_room\x00", "U+0000"), ("book\u200b_room", "U+200B")])
def test_a_tool_name_with_an_invisible_character_is_refused_by_naming_it(name, hidden):
    with pytest.raises(InvalidRequest) as err:
        schemas.parse_args(name, booking())
    assert err.value.message == (
        f"The tool name 'book_room' contains an invisible character, {hidden}; send the name without it."
    )


def test_a_field_name_with_an_invisible_character_is_refused_by_naming_it():
    args = {k: v for k, v in booking().items() if k != "guests"}
    with pytest.raises(InvalidRequest) as err:
        schemas.parse_args("book_room", {**args, "guests\x00": 2, "discount": "100%"})
    assert err.value.message == (
        "I still need the number of guests. "
        "The field name 'guests' contains an invisible character, U+0000; send the name without it. "
        "This tool does not take 'discount'; its fields are guest_name, contact, check_in, check_out, "
        "nights, guests, room_type."
    )


@pytest.mark.parametrize("arguments", [None, [], "book me a room", 42, [booking()]])
def test_arguments_that_are_not_an_object(store, arguments):
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        hotel_support.hotel(store).call("book_room", arguments)


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("find_reservation", {"confirmation_code": "' OR 1=1 --", "last_name": "x"}),
        ("find_reservation", {"confirmation_code": HUGE, "last_name": "Lovelace"}),
        ("find_reservation", {"confirmation_code": "ABCDEFGH", "last_name": SQL}),
        ("find_reservation", {"confirmation_code": 12345678, "last_name": "Lovelace"}),
        (
            "change_or_cancel_reservation",
            {"confirmation_code": "ABCDEFGH", "last_name": "Lovelace", "action": "DROP"},
        ),
        (
            "change_or_cancel_reservation",
            {
                "confirmation_code": "ABCDEFGH",
                "last_name": "Lovelace",
                "action": "cancel",
                "accept_fee": "maybe",
            },
        ),
        ("check_availability", {"check_in": "2030-03-12", "nights": 2, "guests": -1}),
        (
            "check_availability",
            {
                "check_in": "2030-03-12",
                "nights": 2,
                "guests": 2,
                "room_type": "x' UNION SELECT * FROM reservations --",
            },
        ),
        ("check_availability", {"check_in": "yesterday", "nights": 2, "guests": 2}),
        ("hotel_info", {"topic": HUGE}),
        ("hotel_info", {}),
        ("no_such_tool", {}),
    ],
)
def test_hostile_arguments_to_every_tool(store, tool, args):
    before = snapshot(store)
    with pytest.raises(InvalidRequest) as err:
        hotel_support.hotel(store).call(tool, args)
    assert 10 < len(err.value.message) < 400 and HUGE[:100] not in err.value.message
    assert snapshot(store) == before


def test_sql_that_passes_validation_is_only_ever_data(store):
    """Text that survives validation reaches SQL as a bound parameter, never as SQL."""
    hotel = hotel_support.hotel(store)
    before = snapshot(store)
    with pytest.raises(NotFound):  # a well-formed code that does not exist, an apostrophe surname
        hotel.call("find_reservation", {"confirmation_code": "ACDE-FHJK", "last_name": "O'Brien' OR 'x"})
    answer = hotel.call("hotel_info", {"topic": "'; DROP TABLE faq; SELECT '"})
    assert answer["answer"] is None
    assert snapshot(store) == before
    code = hotel.call("book_room", booking(guest_name="Bobby O'Tables-Drop", room_type="standard"))[
        "confirmation_code"
    ]
    assert store.transact(lambda tx: tx.reservation(code)).guest_name == "Bobby O'Tables-Drop"
    assert audit(store) == []


def test_a_model_that_repeats_bad_calls_never_changes_anything(store):
    hotel = hotel_support.hotel(store)
    before = snapshot(store)
    for args in list(BAD_BOOKINGS.values()) * 3:
        with pytest.raises(HotelError):
            hotel.call("book_room", args)
    assert snapshot(store) == before
