"""Nothing personal leaves the worker: the real engine (tiny preset, ticks driven by hand) is made to say what
an agent may say of a guest (teacher-forced turns, one per session), and neither its snapshot's JSON, as the
endpoint serves it, nor the monitoring page's rendered text (Streamlit's AppTest) holds any of it in clear."""

from __future__ import annotations

import json
import re
import socket

import pytest
from streamlit.testing.v1 import AppTest

from engine.api import FunctionCall, ToolResultConsumed
from engine.engine import Engine, EngineConfig
from engine.metrics import SnapshotServer
from engine_support import PROMPT, TOOLS, drain
from test_monitor import PAGE, StepClock, run_ticks, shown_text

BOOK = {
    "name": "book_room",
    "description": "Book a room.",
    "parameters": {
        "type": "object",
        "properties": {"guest_name": {"type": "string"}, "contact": {"type": "string"}},
    },
}
BOOKED = {"guest_name": "Ada Lovelace", "contact": "ada@example.com"}
PHONE_ROOM = "call-_+14155550123_AbCd"

# room label -> (what its agent says last, what must not be left of it, compared without case)
SAID = {
    "room_mail": (
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
    "room_guest": (" Thanks Grace Hopper; Hopper's room is set.", ["grace", "hopper"]),
    "room_booked": (" Augusta, all set for Ada Lovelace. Bye!", ["augusta", "ada", "lovelace"]),
    PHONE_ROOM: (" We'll call you on +1 415 555 0100.", ["415", "555", "0100", "+1"]),
    "room_plain": (" Of course, I can help with that.", []),
}
EVERYWHERE = [
    "14155550123",
    "+1415",
    "grace",
    "hopper",
    "lovelace",
    "augusta",
]  # in no label, no words, no page


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


@pytest.fixture(scope="module")
def talked():
    """One session per SAID entry, each having said its words; room_guest's agent registered the guest's name,
    room_booked's model booked a room for Ada Lovelace, whose result named Augusta Ada King (the engine read
    both names from the call)."""
    engine = Engine(
        EngineConfig(preset="tiny", num_slots=len(SAID), start=False, tool_timeout_s=3600), clock=StepClock()
    )
    server = SnapshotServer(engine.snapshot, port=0)
    handles = {label: engine.open_session(PROMPT, [*TOOLS, BOOK], label=label) for label in SAID}
    run_ticks(engine, 2)  # prompts prefilled: every session live
    handles["room_guest"].keep_private("Grace Hopper")
    booked = handles["room_booked"]
    booked.force_function(engine.tokens.call_ids([{"name": "book_room", "arguments": BOOKED}]))
    run_ticks(engine, 3)
    call = next(o for o in drain(booked) if isinstance(o, FunctionCall))
    booked.submit_tool_result(
        call.call_id, json.dumps({"guest_name": "Augusta Ada King", "status": "confirmed"})
    )
    while not any(isinstance(o, ToolResultConsumed) for o in drain(booked)):
        run_ticks(engine, 1)
    run_ticks(engine, 30)  # the held audio replayed: live again
    tok = engine.tokens
    longest = 0
    for label, (words, _) in SAID.items():
        ids = tok.encode(words)
        longest = max(longest, len(ids))
        handles[label].force_text([tok.bos, *ids, tok.eos] + [tok.pad] * 400)
    run_ticks(engine, longest + 10)
    yield engine, server, {label: h.id for label, h in handles.items()}
    server.close()
    engine.close()


def served_json(server: SnapshotServer) -> dict:
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"GET /snapshot HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])


def test_the_snapshot_carries_no_personal_data(talked):
    engine, server, ids = talked
    snap = served_json(server)
    words = {s["id"]: s["last_words"] for s in snap["sessions"]}
    print({label: words[ids[label]] for label in SAID})
    for label, (said, forbidden) in SAID.items():
        shown = words[ids[label]]
        assert left(said, forbidden) == forbidden  # the agent did say it
        assert shown and left(shown, forbidden) == [], (label, shown)
    assert words[ids["room_plain"]] == "Of course, I can help with that."
    assert "[name]" in words[ids["room_guest"]] and "[name]" in words[ids["room_booked"]]
    assert left(" ".join(strings(snap)), EVERYWHERE) == []
    labels = {s["label"] for s in snap["sessions"]}
    assert labels == set(SAID) - {PHONE_ROOM} | {"call-_•••• 0123_AbCd"}


def test_the_page_shows_no_personal_data(talked, tmp_path, monkeypatch):
    server = talked[1]
    for name in ("DATABASE_URL", "CHORUS_MONITOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CHORUS_MONITOR_URLS", f"http://127.0.0.1:{server.port}/snapshot")
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception and not at.error
    text = shown_text(at).replace(str(tmp_path), "")  # the bookings' folder, named in a caption
    forbidden = sorted({f for _, fs in SAID.values() for f in fs} | set(EVERYWHERE))
    assert left(text, forbidden) == []
    (sessions,) = [d.value for d in at.dataframe if "last words" in d.value.columns]
    rows = {r["room"]: r for r in sessions.to_dict("records")}
    assert (
        "call-_•••• 0123_AbCd" in rows
        and rows["room_plain"]["last words"] == "Of course, I can help with that."
    )
