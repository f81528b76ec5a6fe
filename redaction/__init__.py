"""What of a conversation may leave the worker: names that stand for a person's by a pseudonym, numbers by
their last four digits (`redaction.names`), and the agent's words, where an operator asks for them, with
personal data replaced (`redaction.words`, with the numbers and codes of `redaction.codes` and the titles of
`redaction.titles`). Plain functions on strings, on the standard library and nameparser's vocabulary files
(its code is not imported); the engine, the agent's log and the monitoring page all apply the same rules.
Knows nothing of sessions, HTTP or the page.
"""

from redaction.codes import CODE, NUMBER
from redaction.names import DOTS, MIN_MASKED_DIGITS, mask_numbers, opaque_id, pseudonym
from redaction.titles import vocabulary
from redaction.words import EMAIL, NAME, last_words, private_values, redact


def warm_redaction() -> None:
    """Read what redaction reads on first use (the titles: about 40 ms), so that no request pays for it."""
    vocabulary()


__all__ = [
    "CODE",
    "DOTS",
    "EMAIL",
    "MIN_MASKED_DIGITS",
    "NAME",
    "NUMBER",
    "last_words",
    "mask_numbers",
    "opaque_id",
    "private_values",
    "pseudonym",
    "redact",
    "warm_redaction",
]
