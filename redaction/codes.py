"""Numbers and codes in the agent's words, for `redaction.words`: digits in any grouping, numbers said as
words, codes written (K7Q2, KQAMXYTR), spelled out one letter or digit at a time or in the phonetic alphabet,
and a word said after "code" or "reference". Plain functions on strings.
"""

from __future__ import annotations

import re

from redaction.titles import vocabulary

NUMBER, CODE = "[number]", "[code]"  # what each kind becomes

WORD = r"[^\W_]+(?:['’][^\W_]+)*"  # letters and digits, with inner apostrophes (it's, O'Brien)
TOKEN = re.compile(WORD)

# what may stand between two pieces of one number or code: "0 7 7 0 0, 9 0 0", "(415) 555-0100", "K-7 Q/2"
_GAP = re.compile(r"[\s,.\-/()+:;#*–—]*")

_DIGIT_WORDS = {
    "zero",
    "oh",
    "o",
    "nought",
    "nil",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
    "hundred",
    "thousand",
    "double",
    "triple",
}
_PHONETIC = {
    "alfa",
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "juliett",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "whisky",
    "xray",
    "ray",
    "yankee",
    "zulu",
}
_JOINERS = {"plus", "dash", "hyphen"}  # said between the pieces of a number, never alone
# single letters that are words too (and nameparser's conjunctions: Spanish y, Italian e): part of a code only
# beside a certain piece
_WORD_LETTERS = {"a", "i"}

# after a capital letter, an initial (J. Hopper) or French M. (M. Dupont): no piece of a code
_INITIAL = re.compile(r"\.\s+[^\W\d_]{2}")
# a written code of six letters or more, in lower case too: a q without its u, or five consonants in a row,
# which English words hardly have ("strengths" does)
_CODED = re.compile(r"q(?!u)|[bcdfghjklmnpqrstvwxz]{5}")
# a word said after one of these, then a link (and fillers), is a code however it reads ("code is mentaruy")
_CODE_CUES = {
    "code",
    "codes",
    "passcode",
    "password",
    "pin",
    "reference",
    "confirmation",
    "locator",
    "voucher",
}
_CUE_LINKS = {"is", "was", "reads", "remains", "it's", "that's", "here's"}  # or a colon: "reference: ..."
_CUE_FILLERS = {"it", "still", "number", "your", "the", "a", "of", "for", "booking", "now", "just"}
CUED_CODE_CHARS = 5  # shorter words after a cue ("in", "sent") are left to the other rules


def _kind(token: str) -> str | None:
    """What a word is to the redactor: "digits", "letter" (a single letter that is no word), "mixed" (letters
    and digits: K7Q2), "word-letter" (a, I), "spoken" (a digit or letter said as a word), "joiner", or None
    (an ordinary word)."""
    low = token.lower()
    if token.isdigit():
        return "digits"
    if len(token) == 1 and token.isalpha():
        if not token.isascii():
            return None  # a code is spelled in Latin letters; "à", "ô", "東" are words
        return "word-letter" if low in _WORD_LETTERS or low in vocabulary().conjunctions else "letter"
    if any(c.isdigit() for c in token) and any(c.isalpha() for c in token):
        return "mixed"
    if len(token) >= 6 and token.isalpha() and (token.isupper() or _CODED.search(low)):
        return "mixed"  # a written code of letters only (KQAMXYTR, kqamxytr)
    if low in _DIGIT_WORDS or low in _PHONETIC:
        return "spoken"
    if low in _JOINERS:
        return "joiner"
    return None


def mask_cued_codes(text: str) -> str:
    """A word of CUED_CODE_CHARS or more said after a code cue and a link ("is", a colon), with only fillers
    between, in one sentence, as CODE: "your confirmation code is mentaruy" -> "your confirmation code is
    [code]" (and "your code is valid" -> "your code is [code]": no list of words tells the two apart)."""
    tokens = list(TOKEN.finditer(text))
    out, at = [], 0
    for i, cue in enumerate(tokens):
        if cue.group(0).lower() not in _CODE_CUES or cue.start() < at:
            continue
        prev, linked = cue, False
        for m in tokens[i + 1 : i + 6]:
            gap = text[prev.end() : m.start()]
            if re.search(r"[.!?\[]", gap):
                break  # another sentence, or a placeholder already
            word = m.group(0).lower()
            linked = linked or ":" in gap
            if word in _CUE_LINKS or word in _CUE_FILLERS or word in _CODE_CUES:
                linked, prev = linked or word in _CUE_LINKS, m
                continue
            if linked and len(word) >= CUED_CODE_CHARS:
                out += [text[at : m.start()], CODE]
                at = m.end()
            break
    out.append(text[at:])
    return "".join(out)


def mask_runs(text: str) -> str:
    """Numbers and spelled codes: each run of number-like words (only separators between them) that holds two
    pieces or more, or any single letter that is no word, or any word of letters and digits, as one
    placeholder: CODE when it holds letters, else NUMBER. A lone digit or number word ("one moment") stays."""
    tokens = []
    for m in TOKEN.finditer(text):
        kind = _kind(m.group(0))
        if kind == "letter" and m.group(0).isupper() and _INITIAL.match(text, m.end()):
            kind = None  # an initial
        tokens.append((m.start(), m.end(), m.group(0), kind))
    out, at, i = [], 0, 0
    while i < len(tokens):
        if tokens[i][3] is None:
            i += 1
            continue
        j = i
        while (
            j + 1 < len(tokens)
            and tokens[j + 1][3] is not None
            and _GAP.fullmatch(text[tokens[j][1] : tokens[j + 1][0]])
        ):
            j += 1
        run = tokens[i : j + 1]
        kinds = [k for *_, k in run]
        certain = sum(
            len(t) if k == "digits" else 1 for _, _, t, k in run if k in ("digits", "letter", "mixed")
        )
        spoken = kinds.count("spoken")
        pieces = certain + spoken + (kinds.count("word-letter") if certain else 0)
        if pieces >= 2 or "letter" in kinds or "mixed" in kinds:
            lettered = any(k in ("letter", "mixed", "word-letter") for k in kinds) or any(
                t.lower() in _PHONETIC for _, _, t, _ in run
            )
            start = run[0][0] - (run[0][0] > at and text[run[0][0] - 1] in "+(")  # "+1 415", "(415)"
            out += [text[at:start], CODE if lettered else NUMBER]
            at = run[-1][1]
        i = j + 1
    out.append(text[at:])
    return "".join(out)
