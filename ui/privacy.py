"""What the monitoring page may show of a person: masked phone numbers, names, contacts and codes, and
transcripts cut short. Plain functions on strings; knows nothing of Streamlit, and of the engine only its
string rules (redaction/)."""

from __future__ import annotations

from redaction import DOTS, mask_numbers


def mask_phones(text: str) -> str:
    """Every phone-number-like run of five digits or more in `text` as "•••• 0958" (its last four digits only,
    whatever its grouping or country code); dates and short numbers stay. The engine's own rule
    (`redaction.mask_numbers`), applied again to what a worker sends."""
    return mask_numbers(text)


def mask_name(name: str) -> str:
    """ "Ada Lovelace" -> "A. L***"; one word -> "A***"."""
    words = name.split()
    if not words:
        return ""
    if len(words) == 1:
        return f"{words[0][0]}***"
    return f"{words[0][0]}. {words[-1][0]}***"


def mask_contact(contact: str) -> str:
    """An e-mail address as "a***@example.com", a phone number as mask_phones does, anything else as "***"."""
    contact = contact.strip()
    if "@" in contact:
        user, _, domain = contact.partition("@")
        return f"{user[:1]}***@{domain}"
    masked = mask_phones(contact)
    return masked if masked != contact else "***"


def mask_code(code: str) -> str:
    """A confirmation code (with the guest's last name it opens the booking): its ends only."""
    return f"{code[:2]}{DOTS}{code[-2:]}" if len(code) >= 6 else DOTS


def shorten(text: str, chars: int) -> str:
    """At most the last `chars` characters of a transcript (its end is what was said last), from a word's
    start, "…" in front when cut."""
    text = " ".join(text.split())
    if len(text) <= chars:
        return text
    tail = text[-(chars - 1) :]
    if text[-chars] != " " and " " in tail:  # the cut fell inside a word: drop its end
        tail = tail.split(" ", 1)[1]
    return "…" + tail.lstrip()
