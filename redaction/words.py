"""The agent's words with personal data replaced, where an operator asks for them: `redact` replaces e-mail
addresses (written or spoken), numbers (digits in any grouping, or said as words) and codes (written, spelled
out one letter or digit at a time, in the phonetic alphabet, or said after the word "code": both found by
`redaction.codes`), the session's private terms (guests' names, registered by the agent or taken from its tool
calls' arguments), words after a title (Mr., Sra., Herr, г-н: nameparser's, `redaction.titles`) and
capitalised words inside a sentence (names nobody registered). `last_words` is a turn's end as a snapshot
carries it. Plain functions on strings; knows nothing of sessions, HTTP or the page.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Mapping

from redaction.codes import TOKEN, mask_cued_codes, mask_runs
from redaction.titles import vocabulary

EMAIL, NAME = "[email]", "[name]"  # what each kind becomes (NUMBER and CODE: `redaction.codes`)

# --- the agent's words ----------------------------------------------------------------------------------

# written: grace.hopper@example.com; spoken: "grace dot hopper at example dot com", "ada at example.com"
_LOCAL = r"[\w.+-]+(?:\s+(?:dot|underscore|dash|hyphen)\s+[\w+-]+)*"
_DOMAIN = r"[\w-]+(?:(?:\.|\s+dot\s+|\s*\(dot\)\s*)[\w-]+)+"
_EMAIL = re.compile(
    rf"[\w.+-]+\s*@\s*[\w-]+(?:\.[\w-]+)+|(?<![\w.+-]){_LOCAL}\s*(?:\s+at\s+|\(at\)|\[at\])\s*{_DOMAIN}",
    re.IGNORECASE,
)
# pieces of one, as a turn in progress has them: anything with an @, dotted words (grace.hopper, example.com)
# and words joined by a spoken dot or underscore ("grace dot hopper")
_EMAIL_PART = re.compile(
    r"\S*@\S*|[^\W\d_][\w-]*(?:\.[^\W\d_][\w-]*)+|[^\W\d_][\w-]*(?:\s+(?:dot|underscore)\s+[\w-]+)+",
    re.IGNORECASE,
)
_NOT_NAMES = {
    "a",
    "i",
    "i'm",
    "i'll",
    "i've",
    "i'd",
    "ok",
    "okay",
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
}
_SENTENCE_ENDS = '.!?…:;"“”'  # the last mark before a sentence's first word
_NOT_TITLED = {"and", "or"}  # "Mr. and Mrs. Hopper" (and nameparser's conjunctions: "Sr. y Sra.")


@functools.lru_cache(maxsize=512)
def _terms_pattern(terms: tuple[str, ...]) -> re.Pattern[str] | None:
    """One pattern for the private terms: each term as a phrase (any spacing) and each of its words of two
    letters or more, whole words only (a possessive's "'s" with them), in any case; the longest first."""
    alts: set[str] = set()
    for term in terms:
        words = TOKEN.findall(term)
        if not words:
            continue
        alts.add(r"[\s.,-]*".join(re.escape(w) for w in words))
        alts.update(re.escape(w) for w in words if len(w) >= 2)
    if not alts:
        return None
    body = "|".join(sorted(alts, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{body})(?:['’]s)?(?!\w)", re.IGNORECASE)


def _word_end(text: str, i: int) -> int:
    """Where the word that starts at `i` ends: letters, digits and combining marks (a Devanagari vowel sign,
    an accent written apart), with apostrophes and hyphens between letters (O'Brien, Jean-Luc)."""
    while i < len(text):
        c = text[i]
        joins = c in "'’-" and text[i + 1 : i + 2].isalpha()
        if not (c.isalnum() or unicodedata.category(c).startswith("M") or joins):
            break
        i += 1
    return i


def _opens_sentence(text: str, i: int) -> bool:
    """The word at `i` is a sentence's first: nothing before it, or a sentence's end."""
    before = text[:i].rstrip()
    return not before or before[-1] in _SENTENCE_ENDS


def _caseless(word: str) -> bool:
    """`word` starts in a script without case (Han, Arabic, Hebrew, Devanagari): no capital tells a name."""
    return word[:1].isalpha() and not word[0].isupper() and not word[0].islower()


@functools.cache
def _title_pattern() -> re.Pattern[str]:
    """A title or a single letter (an initial, or French M.), maybe its period, then spaces before a word."""
    titles = "|".join(re.escape(t) for t in sorted(vocabulary().titles, key=len, reverse=True))
    return re.compile(rf"(?<![^\W_])(?P<title>{titles}|[^\W\d_])(?P<dot>\.)?\s+(?=[^\W\d_])", re.IGNORECASE)


def _titled(text: str) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Where `text` holds a title before a name: the titles, shown as they are (start, end), and the names
    after them (start -> end). A title marks the word after it as a name, in any case and script, written with
    a capital (Herr, Sra.), with a mark inside (г-н, Sig.ra), in a script without case (מר, श्रीमती), or as an
    initial (M. Dupont). Where the two read as everyday words it marks none: a title in lower case with no
    period ("let me know", "miss it"), or in Latin letters with one that may end a sentence, before a
    capitalised word ("call me. The spa"; Cyrillic and Greek write theirs so: "проф. Иванов" is a title),
    and a capitalised one with no period that opens a sentence, before a word in lower case ("Me too")."""
    vocab = vocabulary()
    shown: list[tuple[int, int]] = []
    names: dict[int, int] = {}
    for m in _title_pattern().finditer(text):
        title, dotted, start = m.group("title"), m.group("dot") is not None, m.end()
        low, end = title.lower(), _word_end(text, m.end())
        after = text[start:end]
        plain = title.isalpha() and not _caseless(title)
        if low not in vocab.titles:  # a single letter
            if not (dotted and title.isupper() and low not in _NOT_NAMES):
                continue
        elif plain and title.islower():
            latin = any("a" <= c <= "z" for c in low)
            if not dotted or (latin and after[0].isupper()):
                continue
        elif plain and not dotted and after[0].islower() and _opens_sentence(text, m.start()):
            continue
        if low not in vocab.borne:
            shown.append((m.start("title"), m.end("title")))
        word = after.lower()
        if word not in _NOT_TITLED and word not in vocab.conjunctions and word not in vocab.titles:
            names[start] = end
    return shown, names


def _mask_capitalised(text: str, cut: bool = False) -> str:
    """A word after a title (`_titled`), and a capitalised word that does not start a sentence (a name, most
    likely) as NAME; weekdays, months, "I" and titles stay. `cut`: the text starts where a window cut it, so
    its first word has lost what stood before it (a title, the rest of its sentence) and goes when it may be a
    name: capitalised, or in a script without case."""
    vocab = vocabulary()
    shown, names = _titled(text)
    out, at = [], 0
    for i, m in enumerate(TOKEN.finditer(text)):
        if m.start() < at or any(s <= m.start() < e for s, e in shown):
            continue
        word, low = m.group(0), m.group(0).lower()
        if m.start() in names:
            end = names[m.start()]
        elif low in _NOT_NAMES or low in _NOT_TITLED or (low in vocab.titles and low not in vocab.borne):
            continue
        elif (i == 0 and cut and (word[0].isupper() or _caseless(word))) or (
            word[0].isupper() and not _opens_sentence(text, m.start())
        ):
            end = _word_end(text, m.start())
        else:
            continue
        out += [text[at : m.start()], NAME]
        at = end
    out.append(text[at:])
    return "".join(out)


def _email_part(m: re.Match[str]) -> str:
    return m.group(0) if m.group(0).lower() in vocabulary().titles else EMAIL  # Sig.ra, Dott.ssa: titles


def redact(text: str, private: Iterable[str] = (), *, cut: bool = False) -> str:
    """`text` (what the agent said) with personal data replaced: e-mail addresses as EMAIL, the `private`
    terms (and each of their words) as NAME, numbers as NUMBER and codes as CODE (see `mask_cued_codes` and
    `mask_runs`), and words after a title and capitalised words inside a sentence as NAME
    (`_mask_capitalised`). `cut`: `text` starts where a window cut it; its first word goes when it may be a
    name.

    Not caught (tests/test_privacy.py, LIMITS): a name nobody registered when it starts a sentence or is
    written in lower case (after a title in lower case too), one in a script without case inside a sentence
    or after a title no list has, a street address in lower-case words, a spoken e-mail address whose local
    part is two words ("john smith at gmail dot com" keeps "john"), and one not yet finished ("hopper at
    gmail")."""
    text = _EMAIL_PART.sub(_email_part, _EMAIL.sub(EMAIL, text))
    pattern = _terms_pattern(tuple(sorted({t.strip() for t in private if t and t.strip()})))
    if pattern is not None:
        text = pattern.sub(NAME, text)
    return _mask_capitalised(mask_runs(mask_cued_codes(text)), cut)


def last_words(
    pieces: Iterable[str], private: Iterable[str], chars: int, *, truncated: bool = False, going: bool = False
) -> str:
    """The end of a turn as a snapshot may carry it: the pieces joined and redacted, then at most `chars`
    characters from a word's start. A word cut in two is a fragment no rule recognises (a name's "pper", a
    name's "Hop"), so it is left out: the first word when the turn's first pieces were dropped (`truncated`),
    the last one while the turn is still `going` and its text does not end in a space. The word after a
    dropped one lost what stood before it, and goes when it may be a name (`redact`'s `cut`). Remembered: a
    turn that has not changed since the last snapshot is not redacted again."""
    return _last_words(tuple(pieces), tuple(private), chars, truncated, going)


@functools.lru_cache(maxsize=1024)
def _last_words(
    pieces: tuple[str, ...], private: tuple[str, ...], chars: int, truncated: bool, going: bool
) -> str:
    text = "".join(pieces)
    if truncated:
        text = text.lstrip()
        text = text.split(None, 1)[1] if len(text.split(None, 1)) > 1 else ""
    if going and text and not text[-1].isspace():
        text = text.rsplit(None, 1)[0] if len(text.split()) > 1 else ""
    text = " ".join(redact(text, private, cut=truncated).split())
    if len(text) <= chars:
        return text
    tail = text[-chars:]
    return tail.split(" ", 1)[1] if text[-chars - 1] != " " and " " in tail else tail.lstrip()


_PERSONAL_KEY = re.compile(r"name|contact|mail|phone|number|code", re.IGNORECASE)


def private_values(arguments: Mapping[str, object]) -> list[str]:
    """The strings of a tool call's arguments that name or reach a person (keys naming a name, a contact, an
    e-mail, a phone, a number or a code: guest_name, last_name, contact, confirmation_code),
    nested ones too."""
    found: list[str] = []
    if not isinstance(arguments, Mapping):
        return found
    for key, value in arguments.items():
        if isinstance(value, Mapping):
            found += private_values(value)
        elif isinstance(value, list):
            found += [v for v in value if isinstance(v, str)] if _PERSONAL_KEY.search(str(key)) else []
        elif isinstance(value, str) and _PERSONAL_KEY.search(str(key)) and value.strip():
            found.append(value.strip())
    return found
