"""Nothing personal leaves the worker: the real engine (tiny preset, ticks driven by hand) is made to say what
an agent may say of a guest (teacher-forced turns, one per session), in rooms named as callers name them, and
neither its snapshot's JSON, as the endpoint serves it, nor the monitoring page's rendered text (Streamlit's
AppTest) holds any of it in clear. By default they carry no words at all, only counts; with the words turned
on (`EngineConfig.show_words`, the worker's CHORUS_SHOW_WORDS=redacted) they carry them redacted."""

from __future__ import annotations

import json
import re
import socket

import pytest
from livekit import rtc
from streamlit.testing.v1 import AppTest

from agent.call import describe_caller, room_label
from engine.api import FunctionCall, ToolResultConsumed
from engine.observe.metrics import SnapshotServer
from engine.tick.engine import Engine, EngineConfig
from engine_support import drain, run_ticks
from test_monitor import FAR_S, PAGE, StepClock, shown_text
from test_privacy import PHONE_ROOM, caller_room
from testkit.concierge import PROMPT, TOOLS

BOOK = {
    "name": "book_room",
    "description": "Book a room.",
    "parameters": {
        "type": "object",
        "properties": {"guest_name": {"type": "string"}, "contact": {"type": "string"}},
    },
}
BOOKED = {"guest_name": "Ada Lovelace", "contact": "ada@example.com"}
MAIL_ROOM = "web-grace.hopper@example.com"  # room names are the callers' (or their web page's) choice
NAMED_ROOM = "room-Grace-Hopper"

# accented and non-Latin words, each character split over byte tokens and decoded a token at a time: whole
ACCENTS = " Bienvenue, à bientôt: crème brûlée à 東京, ελλάδα, naïve façade 😀."
# a text piece per Cyrillic character: the turn's last 64 pieces, all the engine keeps, start inside
# "замечательно", and the window's first whole word, the name, has no sentence before it
WINDOW_EDGE = " Спасибо замечательно Иван да это номер для вас на две ночи до пятницы и всё."
# room -> (what its agent says last, what must not be left of it, compared without case): what the redactor
# catches, for the words turned on
SAID = {
    MAIL_ROOM: (
        " Done, sent to grace.hopper@example.com; your code is K 7",
        ["grace", "hopper", "example", "K 7"],
    ),
    "room_grouped": (" Your number is 0 7 7 0 0, 9 0 0, 1 2 3.", ["0 7", "9 0 0", "1 2 3"]),
    "room_words": (
        " So oh seven seven oh oh, nine oh oh, one two three.",
        ["seven", "nine", "oh oh", "three"],
    ),
    "room_code": (
        " Your code is kilo seven quebec two, K 7 Q 2 M X.",
        ["kilo", "quebec", "K 7", "Q 2", "M X"],
    ),
    "room_written_code": (" Yes, the code is kqamxytr.", ["kqamxytr"]),
    NAMED_ROOM: (" Thanks Grace Hopper; Hopper's room is set.", ["grace", "hopper"]),
    "room_title": (" Thank you, Mr. Hopper, and Dr. Grace, enjoy your stay.", ["hopper", "grace"]),
    "room_titles_abroad": (
        " Merci, M. Dupont; gracias, Sr. García; danke, Frau schmidt.",
        ["dupont", "garcía", "schmidt"],
    ),
    "room_window_edge": (WINDOW_EDGE, ["иван"]),
    "room_booked": (" Augusta, all set for Ada Lovelace. Bye!", ["augusta", "ada", "lovelace"]),
    PHONE_ROOM: (" We'll call you on +1 415 555 0100.", ["415", "555", "0100", "+1"]),
    "room_plain": (" Of course, I can help with that.", []),
    "room_accents": (ACCENTS, []),
}
# what the redactor misses (tests/test_privacy.py, LIMITS): never shown, the words being off by default
UNCAUGHT = {
    NAMED_ROOM: (
        " thanks grace, that's john smith at gmail dot com, at twelve baker street.",
        ["grace", "john", "smith", "gmail", "baker"],
    ),
    # the number's groups as they would show, not "415" alone: a figure of the page (a count) may be 415
    PHONE_ROOM: (
        " Hopper is the name; we'll call you on +1 415 555 0100.",
        ["hopper", "415 555", "555 0100", "0100"],
    ),
    "room_plain": (" Of course, I can help with that.", ["of course", "help"]),
}
EVERYWHERE = [
    "14155550123",
    "+1415",
    "grace",
    "hopper",
    "example",
    "lovelace",
    "augusta",
]  # in no label, no words, no page


def shown_whole(shown: str) -> bool:
    """`shown` is the end of ACCENTS (the page and the snapshot show a turn's last words), every accented and
    non-Latin word in it whole and none masked."""
    tail = shown.removeprefix("…")
    return ACCENTS.endswith(tail) and all(w in tail for w in ("東京", "ελλάδα", "naïve façade 😀."))


def strings(node) -> list[str]:
    """Every string in a JSON document: keys and values."""
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (k, *strings(v))]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def left(text: str, forbidden: list[str]) -> list[str]:
    """The forbidden words or phrases found in `text` as words (any case)."""
    return [f for f in forbidden if re.search(rf"(?<!\w){re.escape(f)}(?!\w)", text, re.IGNORECASE)]


def open_rooms(engine: Engine, rooms: list[str]) -> dict:
    """A session for each room, labelled as the worker labels it (agent/call.py, describe_caller)."""
    handles = {}
    for room in rooms:
        kind = rtc.ParticipantKind.PARTICIPANT_KIND_SIP if room == PHONE_ROOM else None
        label, caller = describe_caller(caller_room(room, kind), "caller")
        handles[room] = engine.open_session(PROMPT, [*TOOLS, BOOK], label=label, caller=caller)
    return handles


def say(engine: Engine, handles: dict, said: dict) -> None:
    """Each room's agent says its words in one turn."""
    tok = engine.tokens
    longest = 0
    for room, (words, _) in said.items():
        ids = tok.encode(words)
        longest = max(longest, len(ids))
        handles[room].force_text([tok.bos, *ids, tok.eos] + [tok.pad] * 400)
    run_ticks(engine, engine.tick + 1, longest + 10, FAR_S)


@pytest.fixture(scope="module")
def talked():
    """The words turned on: one session per SAID entry, each having said its words; the named room's agent
    registered the guest's name, room_booked's model booked a room for Ada Lovelace, whose result named
    Augusta Ada King (the engine read both names from the call)."""
    config = EngineConfig(
        preset="tiny", num_slots=len(SAID), start=False, tool_timeout_s=3600, show_words="redacted"
    )
    engine = Engine(config, clock=StepClock())
    server = SnapshotServer(engine.snapshot, port=0)
    handles = open_rooms(engine, list(SAID))
    run_ticks(engine, engine.tick + 1, 2, FAR_S)  # prompts prefilled: every session live
    handles[NAMED_ROOM].keep_private("Grace Hopper")
    booked = handles["room_booked"]
    booked.force_function(engine.tokens.call_ids([{"name": "book_room", "arguments": BOOKED}]))
    run_ticks(engine, engine.tick + 1, 3, FAR_S)
    call = next(o for o in drain(booked) if isinstance(o, FunctionCall))
    booked.submit_tool_result(
        call.call_id, json.dumps({"guest_name": "Augusta Ada King", "status": "confirmed"})
    )
    while not any(isinstance(o, ToolResultConsumed) for o in drain(booked)):
        run_ticks(engine, engine.tick + 1, 1, FAR_S)
    run_ticks(engine, engine.tick + 1, 30, FAR_S)  # the held audio replayed: live again
    say(engine, handles, SAID)
    yield engine, server, {room: h.id for room, h in handles.items()}
    server.close()
    engine.close()


@pytest.fixture(scope="module")
def quiet():
    """The default: each UNCAUGHT room's agent has said what the redactor would not catch."""
    engine = Engine(EngineConfig(preset="tiny", num_slots=len(UNCAUGHT), start=False), clock=StepClock())
    server = SnapshotServer(engine.snapshot, port=0)
    handles = open_rooms(engine, list(UNCAUGHT))
    run_ticks(engine, engine.tick + 1, 2, FAR_S)
    say(engine, handles, UNCAUGHT)
    yield engine, server, {room: h.id for room, h in handles.items()}
    server.close()
    engine.close()


def served_json(server: SnapshotServer) -> dict:
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"GET /snapshot HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])


def page_text(monkeypatch, tmp_path, server: SnapshotServer) -> tuple[str, dict]:
    """The page on this worker: all its text, and its sessions' rows by room."""
    for name in ("DATABASE_URL", "CHORUS_MONITOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CHORUS_MONITOR_URLS", f"http://127.0.0.1:{server.port}/snapshot")
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception and not at.error
    (sessions,) = [d.value for d in at.dataframe if "caller" in d.value.columns]
    rows = {r["room"]: r for r in sessions.to_dict("records")}
    return shown_text(at).replace(str(tmp_path), ""), rows  # the bookings' folder, named in a caption


def test_by_default_the_snapshot_carries_counts_and_no_words(quiet):
    engine, server, ids = quiet
    snap = served_json(server)
    rows = {s["id"]: s for s in snap["sessions"]}
    print({room: rows[ids[room]] for room in UNCAUGHT})
    forbidden = sorted({f for _, fs in UNCAUGHT.values() for f in fs} | set(EVERYWHERE))
    assert left(" ".join(strings(snap)), forbidden) == []
    for room, (said, words) in UNCAUGHT.items():
        assert left(said, words) == words  # the agent did say it
        row = rows[ids[room]]
        assert (row["last_words"], row["turns"], row["turn_words"]) == ("", 1, len(said.split()))
        assert row["label"] == room_label(room)
    assert snap["show_words"] == "off"


def test_by_default_the_page_shows_counts_and_no_words(quiet, tmp_path, monkeypatch):
    text, rows = page_text(monkeypatch, tmp_path, quiet[1])
    forbidden = sorted({f for _, fs in UNCAUGHT.values() for f in fs} | set(EVERYWHERE))
    assert left(text, forbidden) == []
    plain = rows[room_label("room_plain")]
    assert "last words" not in plain and (plain["turns"], plain["words"]) == (1, 7)


def test_with_the_words_on_the_snapshot_carries_them_redacted(talked):
    engine, server, ids = talked
    snap = served_json(server)
    words = {s["id"]: s["last_words"] for s in snap["sessions"]}
    print({room: words[ids[room]] for room in SAID})
    for room, (said, forbidden) in SAID.items():
        shown = words[ids[room]]
        assert left(said, forbidden) == forbidden  # the agent did say it
        assert shown and left(shown, forbidden) == [], (room, shown)
    assert words[ids["room_plain"]] == "Of course, I can help with that."
    assert shown_whole(words[ids["room_accents"]])
    assert "[name]" in words[ids[NAMED_ROOM]] and "[name]" in words[ids["room_booked"]]
    assert left(" ".join(strings(snap)), EVERYWHERE) == []
    assert {s["label"] for s in snap["sessions"]} == {room_label(room) for room in SAID}
    assert snap["show_words"] == "redacted"


def test_with_the_words_on_the_page_shows_them_redacted(talked, tmp_path, monkeypatch):
    text, rows = page_text(monkeypatch, tmp_path, talked[1])
    forbidden = sorted({f for _, fs in SAID.values() for f in fs} | set(EVERYWHERE))
    assert left(text, forbidden) == []
    assert set(rows) == {room_label(room) for room in SAID}
    assert rows[room_label("room_plain")]["last words"] == "Of course, I can help with that."
    assert shown_whole(rows[room_label("room_accents")]["last words"])
    assert rows[room_label(PHONE_ROOM)]["caller"] == "phone"
