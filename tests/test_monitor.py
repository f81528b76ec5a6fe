"""The monitoring page (ui/monitor.py) rendered by Streamlit's AppTest from snapshots of the real engine (tiny
preset, dummy weights, ticks driven by hand) served over HTTP by its own SnapshotServer, and bookings made by
the real hotel tools in a SQLite file.
Turns and tool calls are teacher-forced; the rest is the engine's work."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from engine.api import FunctionCall
from engine.observe.metrics import SnapshotServer
from engine.tick.engine import Engine, EngineConfig
from engine_support import CALL, drain, run_ticks
from hotel_support import booking, hotel, seeded_store
from testkit.concierge import PROMPT, TOOLS
from ui.fleet import ms
from ui.privacy import mask_code, mask_contact, mask_name, mask_phones
from ui.settings import MonitorSettings, parse_urls

PAGE = str(Path(__file__).resolve().parent.parent / "ui" / "monitor.py")
PHONE = "+44 20 7946 0958"
SAID = f" Thank you. I have your number as {PHONE}, goodbye."


class StepClock:
    """The engine's clock here: every reading moves it on by 2 ms, so each step measures a few milliseconds
    whatever the machine's load, and the figures on the page are the engine's own, not zeros."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.002
        return self.now


FAR_S = 600.0  # each tick's deadline on the StepClock: far enough that all paused work fits


class Worker:
    """A real engine with sessions in known states, its snapshot served on a free port."""

    def __init__(self, slots: int, sessions: int) -> None:
        config = EngineConfig(preset="tiny", num_slots=slots, start=False, tool_timeout_s=3600)
        self.engine = Engine(config, clock=StepClock())
        self.server = SnapshotServer(self.engine.snapshot, port=0)
        self.url = f"http://127.0.0.1:{self.server.port}/snapshot"
        self.name = f"127.0.0.1:{self.server.port}"
        labels = [("room_a", "web"), (f"sip-{PHONE.replace(' ', '')}", "phone"), ("room_c", "web")]
        self.handles = [
            self.engine.open_session(PROMPT, TOOLS, label=label, caller=caller)
            for label, caller in labels[:sessions]
        ]
        run_ticks(self.engine, self.engine.tick + 1, 2, FAR_S)  # prompts prefilled: every session live

    def close(self) -> None:
        self.server.close()
        self.engine.close()


@pytest.fixture(scope="module")
def busy():
    """Three sessions on four slots: room_a answered one tool call and said SAID, the phone caller waits on a
    tool, room_c is in a turn (talking).
    Pad tokens hold the dummy model to silence around the forced turns."""
    w = Worker(slots=4, sessions=3)
    a, phone, c = w.handles
    tok = w.engine.tokens
    a.force_function(tok.call_ids(CALL))
    phone.force_function(tok.call_ids(CALL))
    run_ticks(w.engine, w.engine.tick + 1, 3, FAR_S)
    call = next(o for o in drain(a) if isinstance(o, FunctionCall))
    a.submit_tool_result(call.call_id, json.dumps({"available": True}))
    run_ticks(
        w.engine, w.engine.tick + 1, 4, FAR_S
    )  # a's result prefilled and its held audio replayed: live again
    said = tok.encode(SAID)
    a.force_text([tok.bos, *said, tok.eos] + [tok.pad] * 400)
    c.force_text([tok.pad] * 4 + [tok.bos] + [tok.pad] * 400)
    run_ticks(w.engine, w.engine.tick + 1, len(said) + 20, FAR_S)  # and at least a second of history
    a.report_playout(0.16, 2, 0.25, 0.03)  # what room_a's playout would report
    c.push_audio(np.zeros(1280, np.float32))  # room_c's caller frame, heard in the next tick
    turn_at = next(s.turn.started_at for s in w.engine.pool.sessions.values() if s.id == c.id)
    c.report_playout(0.0, 0, 0.0, 0.02, turn_at + 0.042)  # its turn's first sample went out 42 ms later
    run_ticks(w.engine, w.engine.tick + 1, 1, FAR_S)
    yield w
    w.close()


@pytest.fixture
def store_env(tmp_path, monkeypatch):
    """A seeded SQLite hotel with one booking (made by the hotel tool) as the page's bookings database."""
    with seeded_store("sqlite", tmp_path) as store:
        hotel(store).book_room(booking(guest_name="Ada Lovelace", contact=PHONE))
    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    for name in ("DATABASE_URL", "CHORUS_MONITOR_TOKEN", "CHORUS_MONITOR_BOOKINGS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def page(monkeypatch, *urls: str, token: str | None = None) -> AppTest:
    monkeypatch.setenv("CHORUS_MONITOR_URLS", ",".join(urls))
    at = AppTest.from_file(PAGE, default_timeout=120)
    if token is not None:
        at.query_params["token"] = token
    return at.run()


def metrics(at: AppTest) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in at.metric:
        out.setdefault(m.label, []).append(m.value)
    return out


def table(at: AppTest, columns: set[str]) -> list[dict]:
    """The rows of the one dataframe on the page that has these columns."""
    found = [d.value for d in at.dataframe if columns <= set(d.value.columns)]
    assert len(found) == 1, [list(d.value.columns) for d in at.dataframe]
    return found[0].to_dict("records")


def shown_text(at: AppTest) -> str:
    """Everything the page shows as text: markdown, captions, banners, metrics and every table cell."""
    parts = [
        e.value for kind in ("markdown", "caption", "error", "warning", "subheader") for e in at.get(kind)
    ]
    parts += [f"{m.label} {m.value}" for m in at.metric]
    parts += [d.value.to_csv() for d in at.dataframe]
    return "\n".join(str(p) for p in parts)


def free_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/snapshot"  # nobody listens there now


def test_one_worker_shows_the_engines_figures_sessions_tool_calls_and_bookings(busy, store_env, monkeypatch):
    at = page(monkeypatch, busy.url)
    assert not at.exception and not at.error
    snap = busy.engine.snapshot()  # the engine stands still between ticks: the page saw these figures
    m = metrics(at)
    assert m["Live sessions"] == ["3 / 4"]
    assert m["Live step p50"] == [ms(snap.live_ms_p50)] and m["Live step p99"] == [ms(snap.live_ms_p99)]
    assert m["Missed deadlines"] == [str(snap.missed_deadlines)]
    assert m["Dropped frames"] == [str(snap.dropped_frames)] and m["Underruns"] == [str(snap.underruns)]
    # on CPU the memory shown is the process's resident size, which moves between the page's read and this one
    (shown,) = m["Device memory"]
    assert shown.endswith(" GiB")
    assert abs(float(shown.removesuffix(" GiB")) - snap.memory_bytes / 2**30) < 0.15
    assert snap.live_ms_p99 > 0 and snap.history_max_ms  # measured steps (on the test's stepping clock)
    assert at.get("vega_lite_chart"), "the tick-time chart"

    rows = {r["room"]: r for r in table(at, {"room", "state", "turns"})}
    assert set(rows) == {"room_a", "sip-•••• 0958", "room_c"}
    a, phone, c = rows["room_a"], rows["sip-•••• 0958"], rows["room_c"]
    assert (a["state"], a["caller"], a["tool calls"]) == ("live", "web", 1)
    assert (phone["state"], phone["caller"], phone["tool"], phone["tool calls"]) == (
        "waiting",
        "phone",
        "check_availability",
        1,
    )
    assert (c["state"], c["tool calls"], c["turns"], c["words"]) == ("live, talking", 0, 1, 0)
    # the agent's words counted, not shown (test_monitor_privacy.py shows them redacted when asked)
    assert (a["turns"], a["words"]) == (1, len(SAID.split())) and "last words" not in a
    assert {s.label: s for s in snap.sessions}["room_a"].last_words == ""
    by_label = {s.label: s for s in snap.sessions}
    for row, s in zip(rows.values(), sorted(snap.sessions, key=lambda s: s.label), strict=True):
        assert row["underruns"] == f"{s.underruns} ({s.underrun_s:g} s)" and s.underruns > 0
    # what the buffers cost: the playout room_a reported, the frame room_c's model heard, its reserve
    assert (a["playout (ms)"], a["start delay (ms)"], a["gaps"]) == ("160", "30", "2 (0.25 s)")
    heard = by_label["room_c"].heard_ms
    assert heard is not None and heard > 0 and c["heard (ms)"] == f"{heard:.0f}" and a["heard (ms)"] == ""
    assert c["inbox reserve"] == 0
    assert (c["turn start (ms)"], a["turn start (ms)"]) == ("42", "")

    (call,) = table(at, {"tools", "tool ms"})
    assert (call["room"], call["tools"], call["ok"]) == ("room_a", "check_availability", True)
    assert call["model ms"] == snap.tool_log[0].call_ms and call["resume ms"] == snap.tool_log[0].resume_ms

    (made,) = table(at, {"guest", "contact"})
    assert (made["guest"], made["contact"], made["nights"]) == ("A. L***", "•••• 0958", 2)

    text = shown_text(at)
    assert "Ada" not in text and "Lovelace" not in text and "7946" not in text and "+44" not in text


def test_an_unreachable_worker_gets_a_banner_and_no_figures(store_env, monkeypatch):
    dead = free_port_url()
    at = page(monkeypatch, dead)
    assert not at.exception
    (banner,) = at.error
    assert "cannot be reached" in banner.value and dead in banner.value and "never answered" in banner.value
    assert not at.metric and not [d for d in at.dataframe if "state" in d.value.columns]


def test_two_workers_side_by_side_and_one_that_stops_answering(busy, store_env, monkeypatch):
    other = Worker(slots=2, sessions=1)
    try:
        at = page(monkeypatch, busy.url, other.url)
        assert not at.exception and not at.error and not at.warning
        m = metrics(at)
        assert m["Workers answering"] == ["2 / 2"] and m["Rooms"] == ["4"] and m["Free slots"] == ["2"]
        assert m["Live sessions"] == ["3 / 4", "1 / 2"]  # each worker's own, side by side
        worst = max(busy.engine.snapshot().live_ms_p99, other.engine.snapshot().live_ms_p99)
        assert m["Worst live step p99"] == [ms(worst)]
        workers = [r["worker"] for r in table(at, {"worker", "room", "state"})]
        assert sorted(workers) == sorted([busy.name] * 3 + [other.name])

        other.server.close()  # the second worker stops answering; the page refreshes
        at.run()
        assert not at.exception
        (warning,) = at.warning
        assert (
            other.name in warning.value
            and "not answering" in warning.value
            and "last answer" in warning.value
        )
        (mark,) = at.error  # in the worker's own column
        assert mark.value.startswith("down:")
        m = metrics(at)
        assert m["Workers answering"] == ["1 / 2"] and m["Rooms"] == ["3"] and m["Free slots"] == ["1"]
        assert m["Live sessions"] == ["3 / 4"]  # the first worker still shows
        workers = {r["worker"] for r in table(at, {"worker", "room", "state"})}
        assert workers == {busy.name}
    finally:
        other.engine.close()


def test_with_a_token_the_page_shows_only_a_refusal_without_it(busy, store_env, monkeypatch):
    monkeypatch.setenv("CHORUS_MONITOR_TOKEN", "s3cret-token")
    at = page(monkeypatch, busy.url)
    assert "Refused" in at.error[0].value and not at.metric and not at.dataframe and not at.sidebar.children
    at = page(monkeypatch, busy.url, token="wrong-token")
    assert "Refused" in at.error[0].value and not at.metric
    at = page(monkeypatch, busy.url, token="s3cret-token")
    assert not at.error and metrics(at)["Live sessions"] == ["3 / 4"]


def test_without_the_token_the_page_shows_its_refusal_before_any_settings_error(store_env, monkeypatch):
    """A refused setting (here the bookings database's) is the operator's to read, not a visitor's: the token
    is checked first."""
    monkeypatch.setenv("CHORUS_MONITOR_TOKEN", "s3cret-token")
    monkeypatch.setenv("DATABASE_URL", "mysql://admin:hunter22@db.internal/hotel")
    for token in (None, "wrong-token"):
        at = page(monkeypatch, free_port_url(), token=token)
        assert not at.exception and not at.metric and not at.dataframe and not at.sidebar.children
        (refusal,) = at.error
        assert refusal.value.startswith("Refused: this page needs its access token")
        text = shown_text(at)
        assert [w for w in ("mysql", "admin", "db.internal", "DATABASE_URL", "settings") if w in text] == []
    at = page(monkeypatch, free_port_url(), token="s3cret-token")  # the operator is told what is wrong
    assert "DATABASE_URL=mysql://admin:***@db.internal/hotel: must be" in at.error[0].value


def test_a_refused_token_setting_lets_nobody_in(store_env, monkeypatch):
    monkeypatch.setenv("CHORUS_MONITOR_TOKEN", "short")
    for token in (None, "short"):
        at = page(monkeypatch, free_port_url(), token=token)
        assert not at.exception and not at.metric and not at.sidebar.children
        (refusal,) = at.error
        assert refusal.value.startswith("Refused") and "short" not in refusal.value


def test_snapshot_urls_from_a_list():
    assert parse_urls("http://a:1, http://b:2/snapshot\nhttp://a:1/") == [
        "http://a:1/snapshot",
        "http://b:2/snapshot",
    ]
    with pytest.raises(ValueError):
        parse_urls("a:1")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("call-_+447700900123_AbC", "call-_•••• 0123_AbC"),  # a SIP room's name
        (f"I have {PHONE}, bye", "I have •••• 0958, bye"),
        ("tel 07700 900123", "tel •••• 0123"),
        ("room_003 on 2030-03-12", "room_003 on 2030-03-12"),  # short numbers and dates stay
    ],
)
def test_phone_numbers_are_masked_wherever_they_appear(text, shown):
    assert mask_phones(text) == shown


def test_guests_are_shown_by_initials_and_masked_contacts():
    assert (mask_name("Ada Lovelace"), mask_name("Cher"), mask_name(" ")) == ("A. L***", "C***", "")
    assert mask_contact("ada@example.com") == "a***@example.com"
    assert mask_contact(PHONE) == "•••• 0958" and mask_contact("by pigeon") == "***"
    assert mask_code("AB12CD34") == "AB••••34"


def test_a_bad_setting_is_named_on_the_page(store_env, monkeypatch):
    at = page(monkeypatch, "ftp://127.0.0.1/snapshot")
    assert not at.exception and not at.metric
    assert "CHORUS_MONITOR_URLS=ftp://127.0.0.1/snapshot: must be" in at.error[0].value


def test_the_example_env_file_names_the_monitors_settings(tmp_path, monkeypatch):
    example = (Path(PAGE).parent.parent / ".env.example").read_text()
    named = set(re.findall(r"^([A-Z_]+)=", example, flags=re.M))
    assert {f.validation_alias for f in MonitorSettings.model_fields.values()} <= named
    for name in named:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(example)
    monkeypatch.chdir(tmp_path)
    settings = MonitorSettings.from_env()
    assert settings.snapshot_urls == ["http://127.0.0.1:8090/snapshot"] and settings.token is None
