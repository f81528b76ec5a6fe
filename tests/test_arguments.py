"""Tool arguments that look like data but are not: days no month has, e-mail addresses with nothing at the
domain, phone numbers in superscript or fullwidth digits, names made of invisible characters or piled with
accents. Each is refused with the sentence the model hears, and nothing is booked; what is accepted is
stored in one normalized form (NFC names, e-mail domains in lower case, phone numbers as E.164)."""

from __future__ import annotations

import re
import string
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotel_support import TODAY, booking
from tools import rules, schemas
from tools.errors import InvalidRequest

FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def refused(hotel, args: dict[str, object]) -> str:
    """What the model hears when it books with `args`; the hotel must have no reservation afterwards."""
    with pytest.raises(InvalidRequest) as err:
        hotel.call("book_room", args, session="call-1")
    assert hotel.reservations() == []
    return err.value.message


def stored(hotel, args: dict[str, object]):
    """The one reservation a booking with `args` made."""
    made = hotel.call("book_room", args, session="call-1")
    (reservation,) = hotel.reservations()
    assert reservation.code == made["confirmation_code"]
    return reservation


# --- dates -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("said", ["0", "00", "the 0th", "٠", "32", "99", "the 32nd"])
def test_a_day_no_month_has_is_refused_in_words(sqlite_hotel, said):
    message = f"The check-in date {said} does not exist on the calendar."
    with pytest.raises(InvalidRequest) as err:
        rules.parse_date(said, TODAY, field="check-in date")
    assert err.value.message == message
    assert refused(sqlite_hotel, booking(check_in=said, nights=2)) == message


def test_a_check_out_on_day_zero_is_refused_in_words(sqlite_hotel):
    assert refused(sqlite_hotel, booking(check_out="the 0th")) == (
        "The check-out date the 0th does not exist on the calendar."
    )


# --- e-mail addresses and phone numbers --------------------------------------------------------------

_NOT_VALID = "The phone number or email is not valid: "
_DIGITS_ONLY = _NOT_VALID + "give a phone number in the digits 0 to 9, or an email address."
_COUNTRY_CODE = (
    "a phone number needs its country code, said with a plus first, like +1 for the US or +44 for the UK."
)


@pytest.mark.parametrize(
    ("contact", "reason"),
    [
        # e-mail addresses that cannot receive mail
        ("x@.com", "an email address cannot have a period immediately after the @-sign."),
        ("a@.", "an email address cannot end with a period."),
        ("a@-.-", "an email address cannot end with a hyphen."),
        ("a@b@example.com", "the part after the @-sign contains invalid characters: '@'."),
        ("ada@example", "the part after the @-sign is not valid. It should have a period."),
        ("\u3164@example.com", "internationalized characters before the @-sign are not supported: '\u3164'."),
        # phone numbers without a country code, with one that does not exist, too short or too long
        ("(415) 555-0123", _COUNTRY_CODE),
        ("+1 415 555", "that phone number is too short for +1."),
        ("+1 415 555 01234", "that phone number is too long for +1."),
        ("+999 123 4567", "that phone number does not start with a country code."),
        ("+1 415 555 0123 4567 8901 2345", "that phone number is too long."),
    ],
)
def test_an_email_address_or_phone_number_that_cannot_be_reached_is_refused(sqlite_hotel, contact, reason):
    assert refused(sqlite_hotel, booking(contact=contact)) == _NOT_VALID + reason


def test_an_email_address_is_stored_with_its_domain_in_lower_case(sqlite_hotel):
    reservation = stored(sqlite_hotel, booking(contact=" Grace.Hopper@Example.COM "))
    assert reservation.contact == "Grace.Hopper@example.com"


@pytest.mark.parametrize(
    "contact",
    [
        "+¹⁴¹⁵⁵⁵⁵⁰¹²³",  # superscript
        "+１４１５５５５０１２３",  # fullwidth, which phonenumbers itself would read
        "+١٤١٥٥٥٥٠١٢٣",  # Arabic-Indic, likewise
        "＋14155550123",  # a fullwidth plus
        "+1 415 555 0123 ext 7",
    ],
)
def test_a_phone_number_is_ascii_digits(sqlite_hotel, contact):
    assert refused(sqlite_hotel, booking(contact=contact)) == _DIGITS_ONLY


@pytest.mark.parametrize(
    ("contact", "e164"),
    [
        ("+1 (415) 555-0123", "+14155550123"),
        ("+44 20 7946 0958", "+442079460958"),
        ("+33.1.23.45.67.89", "+33123456789"),
    ],
)
def test_a_phone_number_is_stored_as_e164(sqlite_hotel, contact, e164):
    assert stored(sqlite_hotel, booking(contact=contact)).contact == e164


# --- names -------------------------------------------------------------------------------------------

_NO_LETTER = "The guest name is not valid: a name needs at least one visible letter."
_ACCENTS = "The guest name is not valid: the name has too many accent marks on its letters."


@pytest.mark.parametrize(
    "name",
    [
        "\u3164",  # HANGUL FILLER, a letter to unicodedata
        "\u115f\u1160",  # the Hangul choseong and jungseong fillers
        "\uffa0",  # HALFWIDTH HANGUL FILLER
        "\u200b",  # ZERO WIDTH SPACE
        "\u2800",  # BRAILLE PATTERN BLANK
        "\u3164 \u200b\u2800 \u00ad",
        "\u2060\ufeff\u180e",  # word joiner, byte order mark, Mongolian vowel separator
    ],
)
def test_a_name_of_invisible_characters_is_refused(sqlite_hotel, name):
    assert refused(sqlite_hotel, booking(guest_name=name)) == _NO_LETTER


@pytest.mark.parametrize(
    "name",
    [
        "a" + "\u0301" * 79,  # one letter under 79 accents
        "A\u0300\u0301\u0302\u0303\u0304 Lovelace",  # four on one letter once NFC makes the first an À
        "A\u0301\u0302\u0303d\u0301\u0302\u0303a\u0301\u0302\u0303",  # three on every letter
    ],
)
def test_a_name_piled_with_accents_is_refused(sqlite_hotel, name):
    assert refused(sqlite_hotel, booking(guest_name=name)) == _ACCENTS


def test_an_accent_must_be_on_a_letter(sqlite_hotel):
    assert refused(sqlite_hotel, booking(guest_name="\u0301Ada Lovelace")) == (
        "The guest name is not valid: a name has an accent that is on no letter."
    )


@pytest.mark.parametrize(
    ("said", "kept"),
    [
        ("Zoe\u0308 Lovelace", "Zoë Lovelace"),  # NFC: one letter with its accent
        ("Ada\u200b \u3164Lovelace\u2800", "Ada Lovelace"),  # the invisible characters are dropped
        ("Ada\u00a0\u3000Lovelace", "Ada Lovelace"),  # any space is one space
        ("שְׁלֹמֹה כהן", "שְׁלֹמֹה כהן"),  # pointed Hebrew: a shin with dagesh, shin dot and vowel
        ("श्रीनिवास राव", "श्रीनिवास राव"),  # Devanagari vowel signs and viramas are marks too
    ],
)
def test_a_name_is_stored_visible_and_normalized(sqlite_hotel, said, kept):
    reservation = stored(sqlite_hotel, booking(guest_name=said))
    assert reservation.guest_name == kept


def test_a_lookup_by_an_invisible_last_name_is_refused(sqlite_hotel):
    with pytest.raises(InvalidRequest) as err:
        sqlite_hotel.call("find_reservation", {"confirmation_code": "ACDE-FHJK", "last_name": "\u3164"})
    assert err.value.message == "The last name is not valid: a name needs at least one visible letter."


def test_a_mark_beside_a_space_is_removed_and_the_last_name_finds_the_booking(sqlite_hotel):
    reservation = stored(sqlite_hotel, booking(guest_name="Grace\u200f Hopper"))
    assert reservation.guest_name == "Grace Hopper"
    found = sqlite_hotel.call(
        "find_reservation", {"confirmation_code": reservation.code, "last_name": "Hopper"}
    )
    assert found["confirmation_code"] == reservation.code


def test_a_name_with_a_direction_override_is_refused_by_its_code_point(sqlite_hotel):
    assert refused(sqlite_hotel, booking(guest_name="Grace\u202erepoH")) == (
        "The guest name is not valid: the name contains an invisible text-direction control (U+202E), which "
        "changes the order its letters are shown in; give the name without it."
    )


def test_a_name_sent_with_ten_thousand_spaces_is_refused(sqlite_hotel):
    assert refused(sqlite_hotel, booking(guest_name=" " * 10_000 + "Al")) == (
        "The guest name is too long; it can be at most 80 characters."
    )


def test_accents_inside_a_precomposed_letter_count_towards_its_three(sqlite_hotel):
    assert refused(sqlite_hotel, booking(guest_name="G\u01d8\u0300\u0301\u0302 Lovelace")) == _ACCENTS


# --- any text ----------------------------------------------------------------------------------------

# Random text, weighted towards the characters above: digits of every kind, fillers, accents, @ and +.
_TRICKY = string.digits + "+@.-() " + "¹٠０\u3164\u115f\u2800\u200b\u00ad\u0301\u05bcaZé"
_text = st.text(st.sampled_from(_TRICKY) | st.characters(), max_size=40)


def _near(*valid: str) -> st.SearchStrategy[str]:
    """Any text, or a valid value with some of it cut out and any text put in its place."""
    spliced = st.tuples(st.sampled_from(valid), st.integers(0, 30), st.integers(0, 3), _text)
    return _text | spliced.map(lambda v: v[0][: v[1]] + v[3][: v[2]] + v[0][v[1] + v[2] :])


def words_or_value(field: str, text: str) -> object | None:
    """`text` as the booking's `field`, parsed: the argument as it is stored, or None when it was refused in
    words (never any other exception)."""
    try:
        args = schemas.parse_args("book_room", booking(**{field: text}))
        if field == "check_in":
            return rules.resolve_stay(args.check_in, None, 2, TODAY, max_nights=30, horizon_days=400)
    except InvalidRequest as e:
        assert 10 < len(e.message) < 400 and e.message.isprintable(), e.message
        return None
    return getattr(args, field)


@FUZZ
@given(_near("Ada Lovelace", "Zoë O'Brien-Núñez", "李 小龍"))
def test_any_name_is_stored_clean_or_refused_in_words(text):
    name = words_or_value("guest_name", text)
    if name is not None:
        assert unicodedata.is_normalized("NFC", name) and " ".join(name.split()) == name
        assert not any(
            unicodedata.category(ch) == "Cf" or ch in "\u3164\u115f\u1160\uffa0\u2800" for ch in name
        )
        assert any(unicodedata.category(ch).startswith("L") for ch in name)


@FUZZ
@given(_near("+1 (415) 555-0123", "+44 20 7946 0958", "Grace.Hopper@Example.COM"))
def test_any_contact_is_stored_clean_or_refused_in_words(text):
    contact = words_or_value("contact", text)
    if contact is not None:
        local, at, domain = contact.rpartition("@")
        if at:
            assert local.isascii() and local.isprintable() and " " not in local and domain == domain.lower()
        else:
            assert re.fullmatch(r"\+[1-9][0-9]{6,16}", contact), contact


@FUZZ
@given(_near("2030-03-12", "the 12th", "March 12", "Friday"))
def test_any_date_is_a_stay_or_refused_in_words(text):
    stay = words_or_value("check_in", text)
    assert stay is None or stay.nights == 2
