"""A guest's name and contact as stored: a name read as it shows and checked to be a plausible personal name,
surnames compared as callers say them, e-mail addresses and phone numbers normalized. Pure; knows nothing of
stays, prices, the database or the model.
"""

from __future__ import annotations

import string
import unicodedata

import email_validator
import phonenumbers

from .rules import clip

# --- names -------------------------------------------------------------------------------------------

NAME_PUNCTUATION = " -'.’"
NAME_MAX = 80  # characters, counted as stored (after NFC, which lengthens some letters)
NAME_SENT_MAX = 2 * NAME_MAX  # characters as sent, spaces and invisible ones included: more is no name
MARKS_PER_LETTER = 3  # accents on one letter: a pointed Hebrew shin carries three (dagesh, shin dot, vowel)
# Characters that show nothing and are not format characters, dropped: the Hangul choseong and jungseong
# fillers (letters to unicodedata), the combining grapheme joiner, the Khmer inherent vowels, the Khitan
# filler and the variation selectors (marks).
_INVISIBLE = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\U00016fe4"
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0)))
)
# Characters that show as a blank but are no space to Python: the Braille blank (a symbol) and the Hangul
# fillers that stand alone (letters). Each counts as a space.
_BLANK = frozenset("\u2800\u3164\uffa0")
# Format characters (Cf) that sit inside a word, dropped: the soft hyphen, the Mongolian vowel separator, the
# zero-width non-joiner and joiner, the word joiner and the zero-width no-break space. Any other format
# character (a zero-width space, a direction mark, an invisible operator, a tag) counts as a space, so that
# it never joins two words into one.
_IN_WORD = frozenset("\u00ad\u180e\u200c\u200d\u2060\ufeff")
# The text-direction embeddings, overrides and isolates: they change the order in which what follows them is
# shown, so a name holding one would be stored as it was not said; it is refused.
_DIRECTION = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _as_shown(ch: str) -> str:
    if ch in _INVISIBLE or ch in _IN_WORD:
        return ""
    if ch in _BLANK or unicodedata.category(ch) == "Cf":
        return " "
    return ch


def clean_name(text: str) -> str:
    """A guest name as stored: NFC, single spaces, invisible characters dropped (those inside a word) or read
    as a space (those between words, and blanks). Raises `ValueError` (the reason, to be said) for text sent
    longer than `NAME_SENT_MAX` or holding a text-direction control, and unless it is a plausible personal
    name: letters with at most `MARKS_PER_LETTER` accents each (and at most two per letter over the name),
    counted with the letters decomposed (NFD, so a precomposed letter's own accents count too), spaces,
    hyphens, apostrophes and periods."""
    if len(text) > NAME_SENT_MAX:
        raise ValueError(f"must be at most {NAME_MAX} characters long")
    if direction := next((ch for ch in text if ch in _DIRECTION), None):
        raise ValueError(
            f"the name contains an invisible text-direction control (U+{ord(direction):04X}), which changes "
            "the order its letters are shown in; give the name without it"
        )
    name = " ".join(unicodedata.normalize("NFC", "".join(map(_as_shown, text))).split())
    letters = marks = 0
    on_letter = -1  # accents on the letter just read; -1 after a space or punctuation (none may follow)
    for ch in unicodedata.normalize("NFD", name):
        category = unicodedata.category(ch)
        if category.startswith("L"):
            letters, on_letter = letters + 1, 0
        elif category.startswith("M"):
            if on_letter < 0:
                raise ValueError("a name has an accent that is on no letter")
            marks, on_letter = marks + 1, on_letter + 1
            if on_letter > MARKS_PER_LETTER:
                raise ValueError("the name has too many accent marks on its letters")
        elif ch in NAME_PUNCTUATION:
            on_letter = -1
        else:
            raise ValueError("a name can only contain letters, spaces, hyphens, apostrophes and periods")
    if not letters:
        raise ValueError("a name needs at least one visible letter")
    if marks > 2 * letters:
        raise ValueError("the name has too many accent marks on its letters")
    if len(name) > NAME_MAX:
        raise ValueError(f"must be at most {NAME_MAX} characters long")
    return name


def _name_words(text: str) -> list[str]:
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    plain = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    plain = plain.replace("'", "").replace("’", "").replace(".", " ").replace("-", " ")
    return plain.split()


def surname_matches(guest_name: str, surname: str) -> bool:
    """True when `surname` is the end of `guest_name`, ignoring case, accents, hyphens, apostrophes
    and spacing (`Garcia Marquez`, `Márquez`, `OBrien` for `O'Brien`; the full name also matches)."""
    given = "".join(_name_words(surname))
    if not given:
        return False
    words = _name_words(guest_name)
    return any("".join(words[i:]) == given for i in range(len(words)))


# --- contacts ----------------------------------------------------------------------------------------

_PHONE_CHARACTERS = frozenset(string.digits + "+-(). ")
_Length = phonenumbers.ValidationResult
_PHONE_PROBLEM = {
    _Length.INVALID_COUNTRY_CODE: "does not start with a country code",
    _Length.TOO_SHORT: "is too short",
    _Length.IS_POSSIBLE_LOCAL_ONLY: "is too short",
    _Length.TOO_LONG: "is too long",
    _Length.INVALID_LENGTH: "has the wrong number of digits",
}
_UNREAD = {  # why phonenumbers could not parse a number, as a length; any other reason is too few digits
    phonenumbers.NumberParseException.INVALID_COUNTRY_CODE: _Length.INVALID_COUNTRY_CODE,
    phonenumbers.NumberParseException.TOO_LONG: _Length.TOO_LONG,
}


def clean_contact(text: str) -> str:
    """A guest's e-mail address or phone number as stored; raises `ValueError` (the reason, to be said).

    An e-mail address (it has an @) is checked by email-validator, offline (no DNS): an ASCII mailbox at a
    real-looking domain, stored normalized (the domain in lower case). A phone number is ASCII digits, with
    + and its country code first (nothing tells which country a number without one is from), spaces,
    dashes, dots and parentheses; phonenumbers must find it the right length for that country, and it is
    stored as E.164 (`+14155550123`).
    """
    text = " ".join(text.split())
    if "@" in text:
        try:
            found = email_validator.validate_email(text, check_deliverability=False, allow_smtputf8=False)
        except email_validator.EmailNotValidError as e:  # its reason is a sentence: "An email address ..."
            reason = clip(str(e), 160)
            raise ValueError(reason[:1].lower() + reason[1:]) from None
        return found.normalized
    if not set(text) <= _PHONE_CHARACTERS or "+" in text[1:]:
        raise ValueError("give a phone number in the digits 0 to 9, or an email address")
    if not text.startswith("+"):
        raise ValueError(
            "a phone number needs its country code, said with a plus first, "
            "like +1 for the US or +44 for the UK"
        )
    try:
        number = phonenumbers.parse(text)
    except phonenumbers.NumberParseException as e:
        problem = _PHONE_PROBLEM[_UNREAD.get(e.error_type, _Length.TOO_SHORT)]
        raise ValueError(f"that phone number {problem}") from None
    length = phonenumbers.is_possible_number_with_reason(number)
    if length != _Length.IS_POSSIBLE:
        country = f" for +{number.country_code}" if length != _Length.INVALID_COUNTRY_CODE else ""
        raise ValueError(f"that phone number {_PHONE_PROBLEM[length]}{country}")
    return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
