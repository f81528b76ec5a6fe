"""Names and numbers that stand for a person's: a room's or a participant's name by a stable pseudonym
(`room-kqzvbxdt`), a number by its last four digits, and random ids with no digit for a number mask to cut.
Plain functions on strings; knows nothing of sessions, HTTP, the page or what was said.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets

DOTS = "••••"
MIN_MASKED_DIGITS = 5  # a number with more digits than the four kept is shown by its last four only

# --- names that stand for a person's ----------------------------------------------------------------------

# consonants only: no pseudonym spells a word or a name, and none holds a digit for a number mask to cut
_PSEUDONYM_LETTERS = "bcdfghjkmnpqrstvwxz"
PSEUDONYM_CHARS = 8  # 19^8, about 1.7e10: distinct between the rooms of a fleet, stable for a name


def pseudonym(kind: str, name: str) -> str:
    """`name` (a room's, a participant's: free text its owner chose, a caller's number in it) as
    "<kind>-<eight consonants>", from a hash of it: the same name gives the same pseudonym in every process
    and on every day, two names almost surely two. Nothing of the name can be read from it; only someone who
    has (or guesses) the exact name can tell which pseudonym is its."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8, person=b"chorus-name")
    n = int.from_bytes(digest.digest(), "big")
    letters = []
    for _ in range(PSEUDONYM_CHARS):
        n, i = divmod(n, len(_PSEUDONYM_LETTERS))
        letters.append(_PSEUDONYM_LETTERS[i])
    return f"{kind}-{''.join(letters)}"


_ID_LETTERS = "abcdefghjkmnpqrstuvwxyz"  # 23 letters: 12 of them carry 54 bits


def opaque_id(length: int = 12) -> str:
    """A random id of letters only (a session's, a tool call's): no run of digits in it, so the log's number
    mask (`mask_numbers`) never takes a piece of it for a phone number and the same id reads the same in the
    log, the snapshot and the page."""
    return "".join(secrets.choice(_ID_LETTERS) for _ in range(length))


# --- numbers in names and contacts --------------------------------------------------------------------

# a run of digits, maybe with a leading + and spaces, dots, dashes or brackets between them; also inside a
# name (call-_+14155550123_AbCd)
_DIGIT_RUN = re.compile(r"(?<![\d+])\+?\d[\d\s().-]*\d(?!\d)")
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _mask_run(m: re.Match[str], min_digits: int) -> str:
    text = m.group(0)
    digits = re.sub(r"\D", "", text)
    if len(digits) < max(min_digits, MIN_MASKED_DIGITS) or _ISO_DATE.fullmatch(text.strip()):
        return text
    return f"{DOTS} {digits[-4:]}"


def mask_numbers(text: str, min_digits: int = MIN_MASKED_DIGITS) -> str:
    """Every number of `min_digits` digits or more in `text` (a phone number in any grouping, with or without
    its +) as "•••• 0100": its last four digits only. Dates (2030-03-12) and shorter numbers stay.
    Idempotent."""
    return _DIGIT_RUN.sub(functools.partial(_mask_run, min_digits=min_digits), text)
