"""A call's trace context crosses the engine's door with its session's `open` (docs/monitoring.md): a room
sends its call's W3C traceparent, the engine keeps it with the session and the snapshot shows its trace id;
anything that is not a traceparent is refused with a sentence, on the room's side before a byte is sent and at
the door, and the refusal costs no slot.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from engine.api import SessionRejected
from engine.client.remote import RemoteEngine
from engine.transport.wire import encode, trace_error, trace_id
from engine_support import engine_on, hosted_engine
from testkit.concierge import PROMPT, TOOLS

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
BAD = [
    f"00-{TRACE.upper()}-00f067aa0ba902b7-01",  # uppercase
    f"01-{TRACE}-00f067aa0ba902b7-01",  # another version
    f"00-{TRACE}-00f067aa0ba902b7",  # no flags
    f"00-{TRACE}-00f067aa0ba902b7-01-",  # something after
    f"00-{TRACE[:-1]}-00f067aa0ba902b7-01",  # a short trace id
    f"00-{'0' * 32}-00f067aa0ba902b7-01",  # the invalid trace id
    f"00-{TRACE}-{'0' * 16}-01",  # the invalid span id
    f" {PARENT}",
    f"{PARENT}\n",
    "Jane Doe +44 20 7946 0000",
]


@pytest.mark.parametrize("bad", [*BAD, None, 7, ["00"]])
def test_only_a_w3c_traceparent_is_taken(bad):
    why = trace_error(bad)
    assert why is not None and why.startswith("trace: a W3C traceparent")
    # the sentence never repeats what was sent
    assert str(bad).strip() not in why


def test_a_traceparent_and_nothing_are_taken():
    assert trace_error(PARENT) is None and trace_error("") is None
    assert trace_id(PARENT) == TRACE and trace_id("") == ""


def test_the_engine_keeps_the_trace_with_the_session_and_the_snapshot_shows_its_id():
    engine = engine_on(num_slots=2, cuda_graph=False)
    try:
        traced = engine.open_session(PROMPT, TOOLS, trace=PARENT)
        untraced = engine.open_session(PROMPT, TOOLS)
        rows = {s.id: s for s in engine.snapshot().sessions}
        assert rows[traced.id].trace_id == TRACE and rows[untraced.id].trace_id == ""
        with pytest.raises(SessionRejected, match="^trace: a W3C traceparent"):
            engine.open_session(PROMPT, TOOLS, trace=BAD[0])
        assert len(engine.pool.sessions) == 2
    finally:
        engine.close()


def _raw_open(host, msg: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect("\0" + host.address)
        s.sendall(encode({"op": "key", "key": host.keys.room}) + encode(msg))
        got = b""
        while b"\n" not in got and (d := s.recv(1 << 16)):
            got += d
    return json.loads(got.split(b"\n", 1)[0])


def test_the_trace_crosses_the_door_and_a_bad_one_is_refused_on_both_sides():
    with hosted_engine(num_slots=2, eager=True) as (engine, host):
        remote = RemoteEngine(host.address, key=host.keys.room)

        async def opens():
            return remote.open_session(PROMPT, TOOLS, trace=PARENT)

        handle = asyncio.run(opens())
        [row] = engine.snapshot().sessions
        assert row.id == handle.id and row.trace_id == TRACE
        # the door refuses what a room's process sends that is not a traceparent, with the sentence
        for bad in (BAD[0], BAD[5], 12):
            reply = _raw_open(host, {"op": "open", "prompt": PROMPT, "tools": TOOLS, "trace": bad})
            assert reply["op"] == "error" and reply["kind"] == "SessionRejected", reply
            assert reply["message"].startswith("trace: a W3C traceparent")
        # the room's side refuses it before a byte is sent
        connections = host.stats["connections"]

        async def bad_open():
            return remote.open_session(PROMPT, TOOLS, trace=BAD[-1])

        with pytest.raises(SessionRejected, match="^trace: a W3C traceparent"):
            asyncio.run(bad_open())
        assert host.stats["connections"] == connections
        assert [s.id for s in engine.pool.sessions.values()] == [handle.id] and engine.pool.available == 1
        handle.close()


def test_a_rooms_session_opens_with_its_calls_traceparent():
    """The room's session (agent/duplex.py) sends its call's traceparent with the open: the engine's row for
    it shows the call's trace id; with tracing off it sends none."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agent import telemetry
    from agent.call_trace import CallTrace
    from agent.duplex import ChorusModel
    from agent.tracing import traceparent
    from wait_support import await_until

    engine = engine_on(num_slots=2, cuda_graph=False, refuse_when_overloaded=False)

    async def open_one() -> tuple[str, str]:
        call = CallTrace("AJ_door")
        call.activate()
        model = ChorusModel(engine)
        session = model.session()
        await session._update_session(instructions=PROMPT, tools=[])
        await await_until(session.opened.is_set, "the slot to open")
        rows = {s.id: s for s in engine.snapshot().sessions}
        got = rows[session.handle.id].trace_id
        await model.aclose()
        call.end("the caller left")
        return got, call.trace_id

    settings = telemetry.TraceSettings(endpoint="http://127.0.0.1:9", schedule_delay_ms=20)
    provider = telemetry.build_provider(InMemorySpanExporter(), "test", settings)
    telemetry.install(provider)
    try:
        got, call_trace_id = asyncio.run(open_one())
    finally:
        telemetry.install(None)
        provider.shutdown()
    try:
        assert len(call_trace_id) == 32 and got == call_trace_id
        untraced, none = asyncio.run(open_one())  # tracing off: the call has no trace, the open sends none
        assert untraced == "" and none == ""
        assert traceparent(CallTrace(None).span) == ""
    finally:
        engine.close()
