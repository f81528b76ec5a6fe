"""Caller text and a guest's name and contact as stored: every text a tool takes with its invisible characters
removed, a name read as it shows and checked to be a plausible personal name, names compared by how they
look (Unicode's confusable skeleton), e-mail addresses and phone numbers normalized, and every refusal
counted. Pure but for those counts; knows nothing of stays, prices, the database or the model.
"""

from __future__ import annotations

import functools
import json
import string
import threading
import unicodedata
from collections import Counter
from importlib import resources

import email_validator
import phonenumbers

from .rules import clip

# --- refusals ----------------------------------------------------------------------------------------


class Refusals:
    """How many texts were refused, by kind: "direction control" (in any text), "name", "email" and "phone".
    Thread-safe; the kinds are fixed words, never the text refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def stats(self) -> dict[str, int]:
        """Refusals since the process started, by kind."""
        with self._lock:
            return dict(self._counts)

    def refused(self, kind: str, reason: str) -> ValueError:
        """Count one refusal of `kind`, and the `ValueError` that says `reason`, to be raised."""
        with self._lock:
            self._counts[kind] += 1
        return ValueError(reason)


REFUSALS = Refusals()  # this process's refusals of caller text (`REFUSALS.stats()`)

# --- any text ----------------------------------------------------------------------------------------

# Characters that show nothing and are not format characters: the Hangul choseong and jungseong fillers
# (letters to unicodedata), the combining grapheme joiner, the Khmer inherent vowels, the Khitan filler and
# the variation selectors (marks). They leave every text a tool takes, with every format character (Cf): the
# zero-width space, non-joiner and joiner, the word joiner, the byte order mark, the soft hyphen, the
# direction marks, the invisible operators, the tags. Removed, never read as a space: a zero-width space
# inside a word leaves it one word, as it shows.
_INVISIBLE = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\U00016fe4"
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0)))
)
# The text-direction embeddings, overrides and isolates: they change the order in which what follows them is
# shown, so a text holding one would be stored as it was not said; it is refused.
_DIRECTION = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(text: str, what: str = "text") -> str:
    """`text` as it shows: every format character and every other character that shows nothing removed.
    Raises `ValueError` (the reason, to be said, naming the text `what`; counted) for a text-direction
    control. Every text a tool takes goes through here, names and contacts included."""
    if text.isascii():  # no ASCII character is invisible in this sense
        return text
    if direction := next((ch for ch in text if ch in _DIRECTION), None):
        raise REFUSALS.refused(
            "direction control",
            f"the {what} contains an invisible text-direction control (U+{ord(direction):04X}), which "
            f"changes the order its letters are shown in; give the {what} without it",
        )
    return "".join(ch for ch in text if ch not in _INVISIBLE and unicodedata.category(ch) != "Cf")


# --- names -------------------------------------------------------------------------------------------

NAME_PUNCTUATION = " -'.’"
NAME_MAX = 80  # characters, counted as stored (after NFC, which lengthens some letters)
NAME_SENT_MAX = 2 * NAME_MAX  # characters as sent, spaces and invisible ones included: more is no name
MARKS_PER_LETTER = 3  # accents on one letter: a pointed Hebrew shin carries three (dagesh, shin dot, vowel)
# Characters that show as a blank but are no space to Python: the Braille blank (a symbol) and the Hangul
# fillers that stand alone (letters). In a name each counts as a space.
_BLANK = frozenset("\u2800\u3164\uffa0")
# Format characters that join what is on either side (the soft hyphen, the Mongolian vowel separator, the
# zero-width non-joiner and joiner, the word joiner, the zero-width no-break space): never a space. Any other
# (a direction mark, a zero-width space, an invisible separator) is one where it stands between two words.
_JOINING = frozenset("\u00ad\u180e\u200c\u200d\u2060\ufeff")
_RIGHT_TO_LEFT = frozenset(("R", "AL"))


def _separates(before: str, after: str) -> bool:
    """Two letters are in two words: a capital after a small letter (`Grace|Hopper`), or the text's direction
    changes between them (`Grace|כהן`)."""
    if not (unicodedata.category(before).startswith("L") and unicodedata.category(after).startswith("L")):
        return False
    if before.islower() and after.isupper():
        return True
    rtl = unicodedata.bidirectional(before) in _RIGHT_TO_LEFT
    return rtl != (unicodedata.bidirectional(after) in _RIGHT_TO_LEFT)


def _word_breaks(text: str) -> str:
    """`text` with each format character (not a joining one) that stands between two words, with nothing but
    invisible characters around it, as a space; the rest are left to `visible`."""
    if text.isascii():
        return text
    hidden = [ch in _INVISIBLE or unicodedata.category(ch) == "Cf" for ch in text]
    out = list(text)
    before = ""  # the last character that shows
    for i, ch in enumerate(text):
        if not hidden[i]:
            before = ch
            continue
        if ch in _JOINING or ch in _DIRECTION or unicodedata.category(ch) != "Cf" or not before:
            continue
        after = next((text[j] for j in range(i + 1, len(text)) if not hidden[j]), "")
        if after and _separates(before, after):
            out[i] = " "
    return "".join(out)


def clean_name(text: str) -> str:
    """A guest name as stored: NFC, single spaces, invisible characters removed (`visible`) but where one
    separates two words (`_word_breaks`), and blanks read as a space. Raises `ValueError` (the reason, to be
    said; counted) for text sent longer than `NAME_SENT_MAX` or holding a text-direction control, and unless
    it is a plausible personal name: letters with at most `MARKS_PER_LETTER` accents each (and at most two
    per letter over the name), counted with the letters decomposed (NFD, so a precomposed letter's own
    accents count too), spaces, hyphens, apostrophes and periods. Letters of any script are kept as they
    were given, look-alikes of other scripts' letters too: names are compared by how they look
    (`name_key`), never changed to look like another."""
    if len(text) > NAME_SENT_MAX:
        raise REFUSALS.refused("name", f"must be at most {NAME_MAX} characters long")
    shown = "".join(" " if ch in _BLANK else ch for ch in visible(_word_breaks(text), "name"))
    name = " ".join(unicodedata.normalize("NFC", shown).split())
    letters = marks = 0
    on_letter = -1  # accents on the letter just read; -1 after a space or punctuation (none may follow)
    for ch in unicodedata.normalize("NFD", name):
        category = unicodedata.category(ch)
        if category.startswith("L"):
            letters, on_letter = letters + 1, 0
        elif category.startswith("M"):
            if on_letter < 0:
                raise REFUSALS.refused("name", "a name has an accent that is on no letter")
            marks, on_letter = marks + 1, on_letter + 1
            if on_letter > MARKS_PER_LETTER:
                raise REFUSALS.refused("name", "the name has too many accent marks on its letters")
        elif ch in NAME_PUNCTUATION:
            on_letter = -1
        else:
            raise REFUSALS.refused(
                "name", "a name can only contain letters, spaces, hyphens, apostrophes and periods"
            )
    if not letters:
        raise REFUSALS.refused("name", "a name needs at least one visible letter")
    if marks > 2 * letters:
        raise REFUSALS.refused("name", "the name has too many accent marks on its letters")
    if len(name) > NAME_MAX:
        raise REFUSALS.refused("name", f"must be at most {NAME_MAX} characters long")
    return name


# --- names compared ----------------------------------------------------------------------------------


@functools.cache
def _prototypes() -> dict[str, str]:
    """Every character that Unicode's confusables.txt (UTS #39) maps, to the text that stands for everything
    that looks like it. Read from confusable-homoglyphs' copy of that file, which lists each character with
    those it maps to or from: each set of look-alikes is one prototype with the characters mapped to it, so
    the prototype is the member linked to more than one, or the member of more than one character. In a set
    of two single characters either stands for both (which one changes no comparison): the lower code point
    does."""
    data = json.loads(
        resources.files("confusable_homoglyphs").joinpath("confusables.json").read_text(encoding="utf-8")
    )

    def plain(text: str) -> str:  # the file shows right-to-left characters between left-to-right marks
        return text.replace("\u200e", "")

    linked: dict[str, set[str]] = {}
    for text, others in data.items():
        linked.setdefault(plain(text), set()).update(plain(other["c"]) for other in others)
    prototypes = {}
    for ch, others in linked.items():
        if len(ch) == 1 and len(others) == 1:
            (other,) = others
            if len(other) > 1 or len(linked[other]) > 1 or other < ch:
                prototypes[ch] = other
    return prototypes


def skeleton(text: str) -> str:
    """UTS #39's skeleton of `text`: NFD, every character replaced by its prototype, NFD again. Two texts
    that look alike (`раураl`, with three Cyrillic letters, and `paypal`) have one skeleton. Case is kept:
    for comparing, not for showing."""
    prototypes = _prototypes()
    mapped = "".join(prototypes.get(ch, ch) for ch in unicodedata.normalize("NFD", text))
    return unicodedata.normalize("NFD", mapped)


@functools.cache
def _latin_twins() -> dict[str, str]:
    """Every letter outside ASCII that looks like an ASCII letter, to that letter in its own case where the
    set has one: Cyrillic о to o and Н to H, Greek Ι to I (whose prototype is l)."""
    members: dict[str, set[str]] = {}
    for ch, prototype in _prototypes().items():
        members.setdefault(prototype, {prototype}).add(ch)
    twins = {}
    for alike in members.values():
        ascii_letters = sorted(ch for ch in alike if ch in string.ascii_letters)
        if not ascii_letters:
            continue
        for ch in alike - set(ascii_letters):
            if len(ch) > 1 or not unicodedata.category(ch).startswith("L"):
                continue
            case = (ch.isupper(), ch.islower())
            same_case = [a for a in ascii_letters if (a.isupper(), a.islower()) == case]
            twins[ch] = (same_case or ascii_letters)[0]
    return twins


def _strip_accents(text: str) -> str:
    return "".join(ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch))


def _word_key(word: str) -> str:
    """One word of a name as it is compared: case folded, and the skeleton of that, until it settles. In a
    word with an ASCII letter, any other letter that looks like an ASCII letter of its case is read as that
    letter first (a capital Cyrillic Н as H, though its small н does not look like h); a word in one other
    script is folded in that script, so `ΠΑΠΑΔΟΠΟΥΛΟΣ` is `Παπαδοπουλος`."""
    if any(ch in string.ascii_letters for ch in word):
        twins = _latin_twins()
        word = "".join(twins.get(ch, ch) for ch in word)
    key = word.casefold()
    for _ in range(4):  # the prototype of a small letter can be a capital (0 is O): fold, map, and again
        folded = _strip_accents(skeleton(key)).casefold()
        if folded == key:
            break
        key = folded
    return key


def _name_words(text: str) -> list[str]:
    plain = _strip_accents(text).replace("'", "").replace("’", "").replace(".", " ").replace("-", " ")
    return [_word_key(word) for word in plain.split()]


def name_key(name: str) -> str:
    """What two spellings of one name share: its words without case, accents, apostrophes, hyphens or periods,
    each by its skeleton (`Grace Hopper`, `GRACE HOPPER`, `Grace Hоpper` with a Cyrillic о and fullwidth
    `Ｇｒａｃｅ Ｈｏｐｐｅｒ` have one key). For comparing only."""
    return " ".join(_name_words(name))


def surname_matches(guest_name: str, surname: str) -> bool:
    """True when `surname` is the end of `guest_name`, ignoring case, accents, hyphens, apostrophes
    and spacing (`Garcia Marquez`, `Márquez`, `OBrien` for `O'Brien`; the full name also matches), and
    letters that look alike (`name_key`)."""
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
    """A guest's e-mail address or phone number as stored, invisible characters removed (`visible`); raises
    `ValueError` (the reason, to be said; counted).

    An e-mail address (it has an @) is checked by email-validator, offline (no DNS): an ASCII mailbox of at
    most 64 characters before the @ (RFC 5321's limit, which email-validator checks only when strict) at a
    real-looking domain, stored normalized (the domain in lower case). A phone number is ASCII digits, with
    + and its country code first (nothing tells which country a number without one is from), spaces,
    dashes, dots and parentheses; phonenumbers must find it the right length for that country, and it is
    stored as E.164 (`+14155550123`).
    """
    text = " ".join(visible(text).split())
    if "@" in text:
        try:
            found = email_validator.validate_email(
                text, check_deliverability=False, allow_smtputf8=False, strict=True
            )
        except email_validator.EmailNotValidError as e:  # its reason is a sentence: "An email address ..."
            reason = clip(str(e), 160)
            raise REFUSALS.refused("email", reason[:1].lower() + reason[1:]) from None
        return found.normalized
    if not set(text) <= _PHONE_CHARACTERS or "+" in text[1:]:
        raise REFUSALS.refused("phone", "give a phone number in the digits 0 to 9, or an email address")
    if not text.startswith("+"):
        raise REFUSALS.refused(
            "phone",
            "a phone number needs its country code, said with a plus first, "
            "like +1 for the US or +44 for the UK",
        )
    try:
        number = phonenumbers.parse(text)
    except phonenumbers.NumberParseException as e:
        problem = _PHONE_PROBLEM[_UNREAD.get(e.error_type, _Length.TOO_SHORT)]
        raise REFUSALS.refused("phone", f"that phone number {problem}") from None
    length = phonenumbers.is_possible_number_with_reason(number)
    if length != _Length.IS_POSSIBLE:
        country = f" for +{number.country_code}" if length != _Length.INVALID_COUNTRY_CODE else ""
        raise REFUSALS.refused("phone", f"that phone number {_PHONE_PROBLEM[length]}{country}")
    return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
