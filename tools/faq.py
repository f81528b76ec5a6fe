"""Answers about the hotel: the FAQ table plus entries derived from the policy (times, cancellation,
rooms), matched to the caller's question by shared words. Pure; no database, no LiveKit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .rules import counted
from .store import FaqEntry, HotelPolicy, RoomType

# Words that say nothing about the topic of a question.
_STOP = frozenset(
    [
        "the",
        "a",
        "an",
        "is",
        "are",
        "do",
        "does",
        "you",
        "your",
        "what",
        "when",
        "where",
        "how",
        "have",
        "there",
        "of",
        "for",
        "to",
        "at",
        "in",
        "on",
        "time",
        "times",
        "hotel",
        "about",
        "any",
        "can",
        "i",
        "my",
        "we",
    ]  # noqa: SIM905 - a word list reads better as words
)


def words(text: str) -> set[str]:
    """Lower-case word stems (a plural `s` dropped), for matching a question to an FAQ topic."""
    found = re.sub(r"[^a-z0-9]+", " ", text.casefold()).split()
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in found}


def entries(faq: Sequence[FaqEntry], policy: HotelPolicy, rooms: Sequence[RoomType]) -> list[FaqEntry]:
    """The FAQ plus what the policy says, so those answers always agree with the rules the tools apply."""
    return [
        *faq,
        FaqEntry(
            "check-in and check-out",
            "checkin checkout arrival departure early late",
            f"Check-in is from {policy.check_in_time} and check-out is until {policy.check_out_time}.",
        ),
        FaqEntry(
            "cancellation policy",
            "cancel refund fee",
            f"Cancelling is free until {policy.free_cancel_days} days before arrival; after that it costs "
            f"{counted(policy.late_cancel_fee_nights, 'night')}.",
        ),
        FaqEntry(
            "room types",
            "bed suite sleep capacity",
            " ".join(f"The {r.name} sleeps {r.max_guests}: {r.description}" for r in rooms),
        ),
    ]


def answer(topic: str, known: Sequence[FaqEntry]) -> dict[str, Any]:
    """The best-matching entry: a word of an entry's topic counts twice one of its keywords ("breakfast
    hours" is about breakfast, not the front desk's hours). No match: the topics we can talk about."""
    asked = words(topic) - _STOP

    def score(entry: FaqEntry) -> int:
        title = words(entry.topic)
        return 2 * len(asked & title) + len(asked & (words(entry.keywords) - title))

    best = max(known, key=score, default=None)  # max keeps the first of equals: the table's order
    if best is None or score(best) == 0:
        topics = ", ".join(e.topic for e in known)
        return {
            "topic": None,
            "answer": None,
            "message": "I don't have that information; the front desk can help. "
            f"I can tell you about {topics}.",
        }
    return {"topic": best.topic, "answer": best.answer, "message": best.answer}
