"""What leaves the worker of a conversation (engine/privacy.py): the redactor against what an agent may say,
numbers in room labels and contacts cut to their last four digits, wherever they are shown."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from livekit import rtc

from agent.call import describe_caller
from engine.privacy import last_words, mask_numbers, private_values, redact
from ui.privacy import mask_contact, mask_phones

# (what the agent said, what must not be left of it: compared without case)
ADVERSARIAL = {
    "e-mail": (
        "Done. It went to grace.hopper@example.com; your code is K 7",
        ["grace", "hopper", "example.com", "@", "K 7"],
    ),
    "spoken e-mail": ("Write to grace dot hopper at example dot com.", ["grace", "hopper", "example"]),
    "unfinished e-mail": ("I have it as grace.hopper@exa", ["grace", "hopper", "exa"]),
    "grouped digits": ("Your number is 0 7 7 0 0, 9 0 0, 1 2 3.", ["0 7", "7 0", "9 0 0", "1 2 3"]),
    "digits as words": (
        "That's oh seven seven oh oh, nine oh oh, one two three.",
        ["seven", "nine", "oh oh", "one two", "three"],
    ),
    "number in words": ("It ends in four one hundred", ["four", "hundred"]),
    "spelled code": ("Your code is K 7 Q 2 M X Y 9.", ["K 7", "Q 2", "M X", "Y 9"]),
    "phonetic code": (
        "Your code is kilo seven quebec two mike x-ray yankee nine.",
        ["kilo", "quebec", "mike", "yankee", "seven", "nine"],
    ),
    "written code": ("Your code is K7QA2MXY, or KQAMXYTR.", ["K7QA2MXY", "KQAMXYTR"]),
    "phone number": ("Call us on +1 415 555 0100 or (415) 555-0100.", ["415", "555", "0100", "+1"]),
    "spelled name": ("That's H O P P E R, thank you.", ["H O P", "P E R"]),
    "unregistered name": ("Thank you, Grace, that is all booked.", ["grace"]),
}


def left(text: str, forbidden: list[str]) -> list[str]:
    return [f for f in forbidden if f.lower() in text.lower()]


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_the_redactor_leaves_nothing_personal(case):
    said, forbidden = ADVERSARIAL[case]
    shown = redact(said)
    print(f"{said!r} -> {shown!r}")
    assert left(said, forbidden) == forbidden  # the case does carry what it is about
    assert left(shown, forbidden) == []
    assert not re.search(r"\d", shown)


def test_the_sessions_private_terms_go_in_any_case_and_possessive_and_ordinary_words_stay():
    said = "Thank you Grace. Ms Hopper's room is booked; grace hopper, see you soon."
    shown = redact(said, ["Grace Hopper"])
    assert shown == "Thank you [name]. Ms [name] room is booked; [name], see you soon."
    for said in (
        "Of course, I can help with that.",
        "One moment, let me check the hotel.",
        "A double room for two nights, from Friday.",
    ):
        assert redact(said, ["Grace Hopper"]) == said


def test_a_word_cut_by_the_turns_window_or_still_being_said_is_left_out():
    # the window kept only the end of "Hopper's", and the turn is still going: "Hop" may become "Hopper"
    pieces = list("pper's stay is booked for Ms Hop")
    shown = last_words(pieces, ["Grace Hopper"], 60, truncated=True, going=True)
    assert shown == "stay is booked for Ms"
    assert last_words(list(" Thanks, goodbye."), (), 60) == "Thanks, goodbye."
    assert len(last_words(list(" word" * 40), (), 60)) <= 60


def test_the_personal_arguments_of_a_tool_call():
    arguments = {
        "guest_name": "Ada Lovelace",
        "contact": "ada@example.com",
        "room_type": "standard",
        "check_in": "Friday",
        "guests": 2,
        "lookup": {"last_name": "Byron"},
    }
    assert private_values(arguments) == ["Ada Lovelace", "ada@example.com", "Byron"]
    assert private_values(["not", "a", "mapping"]) == []


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("+1 415 555 0100", "•••• 0100"),
        ("call-_+14155550123_AbCd", "call-_•••• 0123_AbCd"),  # a SIP dispatch rule's room name
        ("+44 20 7946 0958 or +1-415-555-0100", "•••• 0958 or •••• 0100"),
    ],
)
def test_numbers_keep_only_their_last_four_digits(text, shown):
    assert mask_numbers(text) == shown
    assert mask_numbers(shown) == shown  # masked twice is masked once
    assert mask_phones(text) == shown  # the page's rule is the engine's


def test_a_phone_contact_on_the_page_keeps_only_its_last_four_digits():
    assert mask_contact("+1 415 555 0100") == "•••• 0100"


def test_a_phone_callers_room_label_is_masked_by_the_agent():
    sip = SimpleNamespace(kind=rtc.ParticipantKind.PARTICIPANT_KIND_SIP)
    room = SimpleNamespace(name="call-_+14155550123_AbCd", remote_participants={"sip_caller": sip})
    label, caller = describe_caller(room, "sip_caller")
    assert (label, caller) == ("call-_•••• 0123_AbCd", "phone")


def test_the_frameworks_log_records_name_a_phone_room_by_the_numbers_last_four_digits(caplog):
    """livekit-agents logs a job's room as a record field; a phone call's room is named after the caller's
    number. The worker's filter on the framework's logger masks it (a real record through logging)."""
    import logging

    from agent.settings import AgentSettings
    from agent.worker import build_server

    build_server(AgentSettings())
    with caplog.at_level(logging.INFO, logger="livekit.agents"):
        logging.getLogger("livekit.agents").info(
            "received job request", extra={"room": "call-_+14155550123_AbCd", "job_id": "AJ_x"}
        )
    (record,) = [r for r in caplog.records if r.getMessage() == "received job request"]
    assert record.room == "call-_•••• 0123_AbCd" and record.job_id == "AJ_x"
