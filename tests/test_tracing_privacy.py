"""No personal data in any span: the held personal-data cases (tests/test_privacy.py) put where spans carry
them (livekit-agents' personal fields, the GenAI content it records, rooms and participants by name, numbers,
an exception's text, a span's status), read back from what the export sends (agent/telemetry.py)."""

from __future__ import annotations

import json

import pytest
from opentelemetry.trace import Status, StatusCode

from agent import telemetry, tracing
from agent.call import room_label
from agent.call_trace import CallTrace
from agent.log_privacy import CALLER_DATA_MASK
from test_privacy import ADVERSARIAL, PERSONAL, PHONE_ROOM, ROOMS, left
from tracing_support import exported_spans

IDENTITY = "sip_+14155550123"
SAID = " ".join(said for said, _ in ADVERSARIAL.values())
FORBIDDEN = sorted({*PERSONAL, *(f for _, fs in ADVERSARIAL.values() for f in fs if len(f) > 2)})


def spans_text(spans) -> str:
    """Everything a span sends: its name, attributes, events, links and status, as one text."""
    return json.dumps(
        [
            {
                "name": s.name,
                "attributes": dict(s.attributes or {}),
                "events": [[e.name, dict(e.attributes or {})] for e in s.events],
                "links": [dict(link.attributes or {}) for link in s.links],
                "status": s.status.description,
            }
            for s in spans
        ],
        ensure_ascii=False,
    )


@pytest.fixture
def sent():
    with exported_spans(telemetry.TraceSettings(endpoint="http://127.0.0.1:9")) as read:
        yield read


def test_no_span_carries_a_callers_name_number_or_words(sent):
    from livekit.agents.telemetry import trace_types
    from livekit.agents.telemetry.traces import tracer as framework_tracer

    CALLER_DATA_MASK.learn(PHONE_ROOM, IDENTITY)  # as the room's job does once its caller joined
    with tracing.job_scope("AJ_private"):
        span = framework_tracer.start_span(  # livekit-agents' own spans, through the same provider
            "job_entrypoint",
            attributes={
                trace_types.ATTR_ROOM_NAME: PHONE_ROOM,
                trace_types.ATTR_PARTICIPANT_IDENTITY: IDENTITY,
                trace_types.ATTR_GEN_AI_OUTPUT_MESSAGES: SAID,
                trace_types.ATTR_GEN_AI_TOOL_CALL_ARGUMENTS: '{"guest_name": "Grace Hopper"}',
                "lk.pii.user_input": "I'm Grace Hopper, 12 Baker Street",
                "room": "room-Grace-Hopper",
                "participant": IDENTITY,
                "caller_number": 14155550123,
                "note": f"caller {IDENTITY} in {PHONE_ROOM}",
            },
        )
        span.add_event("participant joined", {"identity": "grace.hopper@example.com", "n": 14155550123})
        try:
            raise RuntimeError("Grace Hopper at +1 415 555 0123 could not be booked")
        except RuntimeError as e:
            span.record_exception(e)
        span.set_status(Status(StatusCode.ERROR, f"no answer from {IDENTITY}"))
        span.end()
    for name in ROOMS:  # Chorus's own call spans, in each held room
        call = CallTrace("AJ_private", room=name)
        with call.step("chorus.room.join"):
            pass
        call.end("the caller left")
    spans = sent()
    text = spans_text(spans)
    print(text)
    assert len(spans) == 1 + 2 * len(ROOMS)
    assert left(text, FORBIDDEN) == []
    calls = [s for s in spans if s.name == "chorus.call"]
    assert left(spans_text(calls), [f for fs in ROOMS.values() for f in fs]) == []  # no digit of a room's
    assert room_label(PHONE_ROOM) in json.loads(text)[0]["attributes"]["note"]  # a room's name, its label
    assert {s.attributes["chorus.room_label"] for s in calls} == {room_label(n) for n in ROOMS}
    assert "0123" in text  # a number keeps its last four digits, as in the log


def test_a_carried_on_calls_previous_trace_id_leaves_whole_though_its_digits_look_like_a_number(sent):
    """The trace id a carried-on call names (`chorus.previous.trace_id`) is random hex, no one's number: a
    run of seven digits in it leaves unmasked, so an operator can follow it to the trace before."""
    import re
    import time

    previous = next(
        f"AJ_{i}"
        for i in range(100000)
        if re.search(r"\d{7}", tracing.trace_id_hex(tracing.job_trace_id(f"AJ_{i}")))
    )
    call = CallTrace("AJ_resumed", room="lobby")
    call.carried_on(previous, "agent lost", 1, time.time() - 1.0)
    call.end("the caller left")
    (span,) = [s for s in sent() if s.name == "chorus.call"]
    assert span.attributes["chorus.previous.trace_id"] == tracing.trace_id_hex(tracing.job_trace_id(previous))
    assert [link.context.trace_id for link in span.links] == [tracing.job_trace_id(previous)]
