"""The monitoring page links each live session to its call's trace (CHORUS_TRACE_URL_TEMPLATE,
ui/trace_links.py): a session opened with its call's traceparent gets the trace store's URL for its trace id,
one without gets no link, no template means no column, and a template that is not an http(s) URL with
`{trace_id}` is named on the page (real engine, tiny preset, served by its own SnapshotServer; ui/monitor.py
rendered by Streamlit's AppTest)."""

from __future__ import annotations

import pytest

from engine.observe.metrics import SnapshotServer
from engine.tick.engine import Engine, EngineConfig
from test_monitor import page, table
from test_monitor import store_env as store_env  # the page's bookings database, a fixture
from testkit.concierge import PROMPT, TOOLS
from ui.trace_links import check_template, trace_link

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TEMPLATE = "https://jaeger.example:16686/trace/{trace_id}?uiFind=chorus"


@pytest.fixture(scope="module")
def traced():
    """Two sessions: room_t opened with its call's traceparent, room_u without."""
    engine = Engine(EngineConfig(preset="tiny", num_slots=2, start=False))
    server = SnapshotServer(engine.snapshot, port=0)
    engine.open_session(PROMPT, TOOLS, label="room_t", trace=f"00-{TRACE}-00f067aa0ba902b7-01")
    engine.open_session(PROMPT, TOOLS, label="room_u")
    yield f"http://127.0.0.1:{server.port}/snapshot"
    server.close()
    engine.close()


@pytest.mark.usefixtures("store_env")
def test_each_session_links_to_its_trace(traced, monkeypatch):
    monkeypatch.setenv("CHORUS_TRACE_URL_TEMPLATE", TEMPLATE)
    at = page(monkeypatch, traced)
    assert not at.exception
    rows = {r["room"]: r["trace"] for r in table(at, {"room", "trace"})}
    assert rows == {"room_t": f"https://jaeger.example:16686/trace/{TRACE}?uiFind=chorus", "room_u": ""}


@pytest.mark.usefixtures("store_env")
def test_without_a_template_there_is_no_trace_column(traced, monkeypatch):
    monkeypatch.delenv("CHORUS_TRACE_URL_TEMPLATE", raising=False)
    at = page(monkeypatch, traced)
    assert not at.exception
    rows = table(at, {"room", "state"})
    assert len(rows) == 2 and all("trace" not in r for r in rows)


@pytest.mark.usefixtures("store_env")
@pytest.mark.parametrize(
    "bad", ["javascript:alert(1)//{trace_id}", "ftp://jaeger/trace/{trace_id}", "http://jaeger/trace/"]
)
def test_a_bad_template_is_named_on_the_page(traced, monkeypatch, bad):
    monkeypatch.setenv("CHORUS_TRACE_URL_TEMPLATE", bad)
    at = page(monkeypatch, traced)
    assert not at.exception and not at.metric
    assert "CHORUS_TRACE_URL_TEMPLATE" in at.error[0].value and "{trace_id}" in at.error[0].value


def test_a_link_only_for_a_trace_id_of_32_hex_digits():
    assert check_template("") == "" and check_template(f" {TEMPLATE} ") == TEMPLATE
    for bad in ("http://jaeger/{trace_id} x", "//jaeger/{trace_id}", "http:///{trace_id}"):
        with pytest.raises(ValueError, match="trace_id"):
            check_template(bad)
    assert trace_link(TEMPLATE, TRACE).endswith(f"/trace/{TRACE}?uiFind=chorus")
    for none in ("", TRACE.upper(), TRACE + "0", "<script>"):
        assert trace_link(TEMPLATE, none) == ""
    assert trace_link("", TRACE) == ""
