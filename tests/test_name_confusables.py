"""Names that look alike are one name: a stay booked again under the same name with a Cyrillic letter, in
fullwidth letters or with an invisible character in it is the same booking, and a lookup finds a name however
it was typed. Invisible characters leave every text a tool takes the same way, a text-direction control is
refused in any of them, and an e-mail address longer before its @ than the standard allows is refused; each
refusal is a sentence the model can say, and counted."""

from __future__ import annotations

import pytest

import hotel_support
from hotel_support import booking
from tools import guests
from tools.audit import audit
from tools.errors import InvalidRequest, NotFound

CYRILLIC_O = "\u043e"  # о
CYRILLIC_EN = "\u041d"  # Н, a capital that looks like H (its small letter н does not look like h)


@pytest.fixture(params=hotel_support.BACKENDS)
def store(request, tmp_path):
    with hotel_support.seeded_store(request.param, tmp_path) as s:
        yield s


def reservations(store) -> list:
    return store.transact(lambda tx: tx.reservations())


def count(kind: str) -> int:
    return guests.REFUSALS.stats().get(kind, 0)


def book(hotel, **args: object) -> str:
    """The confirmation code of a booking made in one call (session) with `args`."""
    return hotel.call("book_room", booking(**args), session="call-1")["confirmation_code"]


def find(hotel, code: str, last_name: str) -> str:
    """The confirmation code of the reservation a lookup by `code` and `last_name` finds."""
    found = hotel.call("find_reservation", {"confirmation_code": code, "last_name": last_name})
    return found["confirmation_code"]


# --- one guest, one stay, one booking ----------------------------------------------------------------

LOOK_ALIKES = [
    f"Grace H{CYRILLIC_O}pper",  # one Cyrillic letter
    f"Grace {CYRILLIC_EN}{CYRILLIC_O}pper",  # two, one of them a capital
    "\uff27\uff52\uff41\uff43\uff45 \uff28\uff4f\uff50\uff50\uff45\uff52",  # fullwidth
    "GRACE HOPPER",
    "Grace Hop\u200bper",  # a zero-width space inside a word
    "\ufeffGrace Hopper",  # a byte order mark
    "Gr\u0430ce Hopper",  # a Cyrillic а in the given name
]


def test_a_stay_booked_again_under_look_alike_names_is_one_reservation(store):
    hotel = hotel_support.hotel(store)
    # the standard room, of which there are three: a second booking would be made, not refused as sold out
    first = book(hotel, guest_name="Grace Hopper", room_type="standard")
    for name in LOOK_ALIKES:
        assert book(hotel, guest_name=name, room_type="standard") == first, name
    (reservation,) = reservations(store)
    assert reservation.code == first and reservation.guest_name == "Grace Hopper"
    assert audit(store) == []  # one room held on each night, by the one reservation


def test_a_name_stored_with_a_look_alike_letter_is_the_same_guest_booked_in_latin(store):
    hotel = hotel_support.hotel(store)
    mixed = f"Grace H{CYRILLIC_O}pper"
    first = book(hotel, guest_name=mixed, room_type="standard")
    assert book(hotel, guest_name="Grace Hopper", room_type="standard") == first
    # the name is folded for comparison only: it is stored as it was given
    assert [r.guest_name for r in reservations(store)] == [mixed]


def test_a_different_name_is_still_a_different_booking(store):
    hotel = hotel_support.hotel(store)
    names = ["Grace Hooper", "Grace Hoppe", "Grace Hopper"]
    for name in names:
        book(hotel, guest_name=name, room_type="standard")
    assert sorted(r.guest_name for r in reservations(store)) == names
    assert audit(store) == []


# --- lookups -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "said"),
    [
        (f"Grace H{CYRILLIC_O}pper", "Hopper"),
        ("Grace Hopper", f"H{CYRILLIC_O}pper"),
        ("Grace Hopper", "\uff28\uff4f\uff50\uff50\uff45\uff52"),  # Ｈｏｐｐｅｒ
        ("Grace \uff28\uff4f\uff50\uff50\uff45\uff52", "Hopper"),
        (f"Grace {CYRILLIC_EN}opper", "hopper"),
        ("Grace Hopper", "\u041d\u041e\u0420\u0420\u0415R"),  # НОРРЕ in Cyrillic capitals, then a Latin R
        ("Grace Hopper", "Hop\u200bper"),
        ("Hans Müller", "MULLER"),
        ("José García", "garcia"),
        ("Zoë Lovelace", "Lovelace"),
        # a name in one script of its own
        ("Γιώργος Παπαδόπουλος", "Παπαδόπουλος"),
        ("Γιώργος Παπαδόπουλος", "ΠΑΠΑΔΟΠΟΥΛΟΣ"),
        ("Иван Иванов", "ИВАНОВ"),
        ("太郎 山田", "山田"),
        ("محمد عبد الله", "عبد الله"),
        ("Müller", "Müller"),
    ],
)
def test_a_name_is_kept_as_typed_and_found_however_it_was_said(store, stored, said):
    hotel = hotel_support.hotel(store)
    code = book(hotel, guest_name=stored)
    (reservation,) = reservations(store)
    assert reservation.guest_name == stored
    assert find(hotel, code, said) == code


@pytest.mark.parametrize(
    ("name", "surname"),
    [
        ("Grace Hopper", "Hooper"),
        ("Иван Иванов", "Ivanov"),  # a transliteration is another name, not a look-alike
        ("Ada Lovelace", "Love"),
        ("Ada Lovelace", f"L{CYRILLIC_O}ve"),
    ],
)
def test_a_different_surname_is_not_found(name, surname):
    assert guests.surname_matches(name, surname) is False


def test_a_lookup_by_a_look_alike_of_another_name_is_not_found(store):
    hotel = hotel_support.hotel(store)
    code = book(hotel, guest_name="Grace Hopper")
    with pytest.raises(NotFound):
        find(hotel, code, "Hooper")


# --- the skeleton ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("\u0440\u0430\u0443\u0440\u0430l", "paypal"),  # раураl: Cyrillic р, а, у
        ("\U0001d52d\U0001d51e\U0001d536", "pay"),  # 𝔭𝔞𝔶, mathematical fraktur
        ("m", "rn"),  # Unicode's own example of two letters that read as one
        ("\u0391\u0392\u0395", "ABE"),  # Greek capitals
    ],
)
def test_look_alikes_share_a_skeleton(one, other):
    assert guests.skeleton(one) == guests.skeleton(other)


@pytest.mark.parametrize(("one", "other"), [("paypal", "paypa1x"), ("Hopper", "Hooper"), ("H", "h")])
def test_different_text_has_different_skeletons(one, other):
    assert guests.skeleton(one) != guests.skeleton(other)


# --- invisible characters ----------------------------------------------------------------------------

INVISIBLE = {
    "ZERO WIDTH SPACE": "\u200b",
    "ZERO WIDTH NON-JOINER": "\u200c",
    "ZERO WIDTH JOINER": "\u200d",
    "LEFT-TO-RIGHT MARK": "\u200e",
    "RIGHT-TO-LEFT MARK": "\u200f",
    "WORD JOINER": "\u2060",
    "INVISIBLE TIMES": "\u2062",
    "BYTE ORDER MARK": "\ufeff",
    "SOFT HYPHEN": "\u00ad",
    "ARABIC LETTER MARK": "\u061c",
    "MONGOLIAN VOWEL SEPARATOR": "\u180e",
    "TAG LATIN SMALL LETTER A": "\U000e0061",
    "COMBINING GRAPHEME JOINER": "\u034f",
    "VARIATION SELECTOR-16": "\ufe0f",
}
DIRECTION = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]


@pytest.mark.parametrize("invisible", INVISIBLE.values(), ids=INVISIBLE.keys())
def test_an_invisible_character_is_removed_and_never_splits_a_word(invisible):
    assert guests.visible(f"Hop{invisible}per") == "Hopper"
    assert guests.clean_name(f"Grace Hop{invisible}per") == "Grace Hopper"


@pytest.mark.parametrize(
    "field",
    [
        {"guest_name": "Ada Love\u200blace"},
        {"guest_name": "\ufeffAda Lovelace"},
        {"contact": "ada\ufeff@example.com"},
        {"contact": "+44 20 7946\u200b 0958"},
        {"check_in": "2030-03-12\ufeff"},
        {"check_in": "March 1\u200b2"},
        {"room_type": "de\u200bluxe"},
    ],
    ids=repr,
)
def test_an_invisible_character_in_any_field_is_removed_the_same_way(store, field):
    hotel = hotel_support.hotel(store)
    code = book(hotel, **field)
    (reservation,) = reservations(store)
    assert (reservation.code, reservation.guest_name) == (code, "Ada Lovelace")
    assert (reservation.room_type, reservation.check_in.day) == ("deluxe_king", 12)
    assert reservation.contact in ("ada@example.com", "+442079460958")


def test_an_invisible_character_in_a_question_is_removed(store):
    hotel = hotel_support.hotel(store)
    said = hotel.call("hotel_info", {"topic": "break\u200bfast"})
    assert said == hotel.call("hotel_info", {"topic": "breakfast"})


@pytest.mark.parametrize("control", DIRECTION, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize(
    ("field", "label", "what"),
    [
        ("guest_name", "guest name", "name"),
        ("contact", "phone number or email", "text"),
        ("check_in", "check-in date", "text"),
        ("room_type", "room type", "text"),
    ],
)
def test_a_direction_control_in_any_field_is_refused_in_words_and_counted(store, control, field, label, what):
    hotel = hotel_support.hotel(store)
    before = count("direction control")
    with pytest.raises(InvalidRequest) as err:
        hotel.call("book_room", booking(**{field: booking()[field] + control}), session="call-1")
    assert err.value.message == (
        f"The {label} is not valid: the {what} contains an invisible text-direction control "
        f"(U+{ord(control):04X}), which changes the order its letters are shown in; "
        f"give the {what} without it."
    )
    assert count("direction control") == before + 1
    assert reservations(store) == []


# --- e-mail addresses --------------------------------------------------------------------------------


def test_an_email_address_longer_than_64_characters_before_the_at_is_refused_and_counted(store):
    hotel = hotel_support.hotel(store)
    before = count("email")
    with pytest.raises(InvalidRequest) as err:
        hotel.call("book_room", booking(contact="a" * 65 + "@example.com"), session="call-1")
    assert err.value.message == (
        "The phone number or email is not valid: "
        "the email address is too long before the @-sign (1 character too many)."
    )
    assert count("email") == before + 1
    assert reservations(store) == []
    hotel.call("book_room", booking(contact="a" * 64 + "@example.com"), session="call-1")
    assert [r.contact for r in reservations(store)] == ["a" * 64 + "@example.com"]


def test_a_refused_name_and_phone_number_are_counted():
    names, phones = count("name"), count("phone")
    with pytest.raises(ValueError):
        guests.clean_name("Ada 😀")
    with pytest.raises(ValueError):
        guests.clean_contact("+1 415")
    assert (count("name"), count("phone")) == (names + 1, phones + 1)


SEPARATING = {
    "RIGHT-TO-LEFT MARK": "\u200f",
    "LEFT-TO-RIGHT MARK": "\u200e",
    "ARABIC LETTER MARK": "\u061c",
    "ZERO WIDTH SPACE": "\u200b",
    "INVISIBLE SEPARATOR": "\u2063",
}


@pytest.mark.parametrize("mark", SEPARATING.values(), ids=SEPARATING.keys())
@pytest.mark.parametrize(
    ("sent", "stored", "said"),
    [
        ("Grace{}Hopper", "Grace Hopper", "Hopper"),  # a capital after a small letter starts a word
        ("Grace{}כהן", "Grace כהן", "כהן"),  # the direction changes between them
        ("שרה{}Hopper", "שרה Hopper", "Hopper"),
    ],
)
def test_a_format_character_between_two_words_is_a_space(store, mark, sent, stored, said):
    """An invisible format character where one word ends and the next begins (a right-to-left mark between a
    given name and a surname) keeps them two words: the guest is stored with a space there and found by
    their surname. Inside a word it is removed (the test of invisible characters above)."""
    hotel = hotel_support.hotel(store)
    code = book(hotel, guest_name=sent.format(mark))
    (reservation,) = reservations(store)
    assert reservation.guest_name == stored
    assert find(hotel, code, said) == code
