"""A call's trace through the real stack: a caller's call with a tool call through the real LiveKit server
(scripts/livekit.sh), its spans sent by the worker and its room's process to a real Jaeger
(scripts/jaeger.sh) and read back through Jaeger's query API: there, nested and in order, with the worker's
own figures, and with nothing personal. After the worker serving a call is SIGKILLed, the call carried on by
another worker's agent has a trace linked to the first. A collector that hangs, or is gone, changes nothing
for the call.
Without Jaeger (JAEGER_QUERY_URL) the tests skip; under CI=true they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import threading
import time
import urllib.request
import uuid

import pytest

from agent import tracing
from livekit_support import POLL_S, require_livekit, scripted_booking
from test_livekit import booking_rows
from testkit.callers import Caller, caller_pcm
from testkit.fleet import kill_worker, one_fault, two_workers
from testkit.worker import Worker
from wait_support import await_until, wait_until

pytestmark = pytest.mark.livekit

PERSONAL = ["rowan", "example.com"]  # the scripted booking's guest and contact (livekit_support.py)


@pytest.fixture(scope="module")
def server():
    return require_livekit()


@pytest.fixture(scope="module")
def jaeger() -> tuple[str, str]:
    """(the OTLP endpoint, the query URL) of scripts/jaeger.sh's start_jaeger."""
    query, otlp = os.environ.get("JAEGER_QUERY_URL"), os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not query or not otlp:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "no Jaeger: run the suite as .ci/run does (scripts/jaeger.sh: start_jaeger)"
        )
    return otlp, query


def get_trace(query: str, trace_id: str) -> list[dict]:
    """The trace's spans as Jaeger's query API returns them ([] while it has none)."""
    try:
        with urllib.request.urlopen(f"{query}/api/traces/{trace_id}", timeout=5) as r:
            data = json.load(r)["data"]
    except OSError:
        return []
    return data[0]["spans"] if data else []


def get_processes(query: str, trace_id: str) -> dict:
    with urllib.request.urlopen(f"{query}/api/traces/{trace_id}", timeout=5) as r:
        return json.load(r)["data"][0]["processes"]


def tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span.get("tags", [])}


def parent_of(span: dict) -> str | None:
    refs = [r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
    return refs[0] if refs else None


def job_of(log: str) -> str:
    """The job id of the call a worker served, from its log (the line its job logs once its caller joined:
    "job AJ_...: standard <the caller's label> joined")."""
    found = re.findall(r"job (AJ_\w+): standard \S+ joined", log)
    assert found, log[-3000:]
    return found[-1]


def booking_call(server, worker: Worker, store_dir, seconds: float = 6.0) -> str:
    """A caller's call whose script books a room 2 s in: the caller speaks, waits for the booking's row and
    the words after it, then leaves; returns the room's name."""
    metadata, _ = scripted_booking(days_ahead=12, at_s=2.0)

    async def call() -> str:
        room = f"trace-{uuid.uuid4().hex[:8]}"
        caller = Caller(server, room, worker.agent_name, metadata=metadata)
        await caller.join()
        await asyncio.wait_for(caller.first_audio.wait(), 60)
        await caller.speak(caller_pcm("caller_booking.wav"), seconds=seconds)
        await await_until(lambda: booking_rows(store_dir), "the booking", 60, every=POLL_S)
        said = lambda: "thanks for waiting" in caller.heard.text().lower()  # noqa: E731
        await await_until(said, "the words after it", 60, every=POLL_S)
        await caller.leave()
        return room

    return asyncio.run(call())


def test_a_calls_trace_with_a_tool_call_is_read_back_from_jaeger(server, store_dir, jaeger):
    otlp, query = jaeger
    service = f"chorus-test-{uuid.uuid4().hex[:6]}"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with Worker(server, store_dir, slots=2, **env) as worker:
        room = booking_call(server, worker, store_dir)
        wait_until(lambda: "call ended" in worker.log.read_text(errors="replace"), "the call's end", 60)
        log = worker.log.read_text(errors="replace")
        job = job_of(log)
        trace_id = tracing.trace_id_hex(tracing.job_trace_id(job))

        def complete() -> list[dict]:
            spans = get_trace(query, trace_id)
            names = {s["operationName"] for s in spans}
            want = {"chorus.job", "chorus.call", "chorus.tool_call", "agent_turn", "job_entrypoint"}
            return spans if want <= names else []

        # read while the worker runs: the room's process ends its job (livekit-agents' `job_entrypoint`
        # ends after the job's shutdown) on its own time, as it would in service
        seen = lambda: sorted({s["operationName"] for s in get_trace(query, trace_id)})  # noqa: E731
        spans = wait_until(complete, "the call's trace in Jaeger", 60, every=POLL_S * 5, seen=seen)
    text = json.dumps(spans)
    if os.environ.get("CHORUS_TEST_TRACE_JSON"):  # the trace as the query API gave it (docs/monitoring.md)
        with open(os.environ["CHORUS_TEST_TRACE_JSON"], "w") as f:
            json.dump({"data": [{"spans": spans, "processes": get_processes(query, trace_id)}]}, f)
    print(json.dumps([(s["operationName"], s["duration"], tags(s)) for s in spans], indent=1)[:6000])
    by = {}
    for s in spans:
        by.setdefault(s["operationName"], []).append(s)
    (job_span,), (call,) = by["chorus.job"], by["chorus.call"]
    assert parent_of(job_span) is None and tags(job_span)["chorus.outcome"] == "accepted"
    assert parent_of(call) == job_span["spanID"]  # the room's process continued the worker's trace
    # and livekit-agents' own spans of the job with it (its root, `job_entrypoint`, adopted by the job's)
    assert {"room_connect", "session_start", "agent_turn"} <= set(by), sorted(by)
    (root,) = by["job_entrypoint"]  # ended after the job's shutdown, and sent
    assert parent_of(root) == job_span["spanID"]
    for name in ("chorus.room.join", "chorus.session.admit", "chorus.first_frame", "chorus.turn"):
        assert name in by and all(parent_of(s) == call["spanID"] for s in by[name]), name
    # in order: the job accepted, the room joined, the session admitted, its first frame, the turns
    start = {n: min(s["startTime"] for s in by[n]) for n in by}
    assert start["chorus.job"] <= start["chorus.call"] <= start["chorus.room.join"]
    assert start["chorus.room.join"] < start["chorus.session.admit"] <= start["chorus.first_frame"]
    assert start["chorus.first_frame"] <= start["chorus.turn"]
    (tool,) = [s for s in by["chorus.tool_call"] if tags(s)["chorus.tool"] == "book_room"]
    t = tags(tool)
    assert t["chorus.outcome"] == "ok" and t["chorus.model_ms"] >= 0 and t["chorus.tool_ms"] > 0
    parts = {s["operationName"]: s for s in spans if parent_of(s) == tool["spanID"]}
    assert set(parts) == {"chorus.tool.model", "chorus.tool.run", "chorus.tool.prefill"}
    run = parts["chorus.tool.run"]
    assert abs(run["duration"] / 1000 - t["chorus.tool_ms"]) <= 1.0  # Jaeger's microseconds, the span's ms
    assert (
        parts["chorus.tool.model"]["startTime"]
        <= run["startTime"]
        <= parts["chorus.tool.prefill"]["startTime"]
    )
    # the worker's own figure: the room's log line of the session's first frame
    (logged,) = [float(m) for m in re.findall(r"first frame (\d+) ms after it was asked for", log)]
    (first,) = by["chorus.first_frame"]
    assert abs(first["duration"] / 1000 - logged) <= 5.0, (first["duration"], logged)
    # the call's log lines carry its trace's id: a log search finds the trace
    assert trace_id in log
    assert len([line for line in log.splitlines() if trace_id in line]) >= 3
    # nothing personal: the booking's guest, their contact, the room's name
    assert [p for p in [*PERSONAL, room] if p.lower() in text.lower()] == []
    assert tags(call)["chorus.end_reason"]


def test_after_a_worker_sigkill_the_resumed_calls_trace_links_to_the_first(server, store_dir, jaeger):
    """A caller on one of two workers; the worker serving it SIGKILLed; the call carried on by an agent of the
    other (tests/test_livekit_fleet.py). Read back from Jaeger: the resumed call's `chorus.call` links to the
    first call's trace (its worker's span of the job), with the re-dispatch's reason and the silence the
    caller met."""
    if not server.redis:
        pytest.fail("the LiveKit server runs without Redis (scripts/livekit.sh starts one with redis-server)")
    otlp, query = jaeger
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"
    with two_workers(server, store_dir, name, **env) as stack:
        got = asyncio.run(one_fault(server, stack.workers, name, kill_worker))
        survivor = stack.workers[1 - got["victim"]]
        # the caller has left: the resumed call's span ends, and is sent, before its job logs the call's end
        # (agent/room.py); the workers are stopped only then, or the span would go down with its process
        wait_until(lambda: "call ended" in survivor.log.read_text(errors="replace"), "the call's end", 60)
        logs = [w.log.read_text(errors="replace") for w in stack.workers]
    first_job, resumed_job = job_of(logs[got["victim"]]), job_of(logs[1 - got["victim"]])
    assert f"job {resumed_job}: carries the call on after a break" in logs[1 - got["victim"]]
    first_trace = tracing.trace_id_hex(tracing.job_trace_id(first_job))
    resumed_trace = tracing.trace_id_hex(tracing.job_trace_id(resumed_job))

    def resumed_call() -> dict | None:
        calls = [s for s in get_trace(query, resumed_trace) if s["operationName"] == "chorus.call"]
        return calls[0] if calls else None

    seen = lambda: sorted({s["operationName"] for s in get_trace(query, resumed_trace)})  # noqa: E731
    call = wait_until(resumed_call, "the resumed call's span in Jaeger", 60, every=POLL_S * 5, seen=seen)
    print(json.dumps({"references": call["references"], "tags": tags(call)}, indent=1))
    links = [r for r in call["references"] if r["refType"] == "FOLLOWS_FROM"]
    assert [(r["traceID"], r["spanID"]) for r in links] == [
        (first_trace, f"{tracing.job_span_id(first_job):016x}")
    ]
    t = tags(call)
    assert t["chorus.redispatch_reason"] == "agent lost" and t["chorus.breaks"] == 1
    assert t["chorus.previous.trace_id"] == first_trace
    # from about when the first agent last spoke (its conversation's last save) to the new session's first
    # frame: some time, and not more than the first turn's end to the new voice with the test's waits
    assert 0 < t["chorus.silence_ms"] <= 1000 * (got["after_s"] + 60), (t, got["after_s"])
    # the first call's trace is there too, its worker's span of the job sent before the kill
    assert "chorus.job" in {s["operationName"] for s in get_trace(query, first_trace)}


@contextlib.contextmanager
def silent_listener():
    """A TCP port that accepts every connection and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        for s in [*held, sock]:
            s.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("collector", ["hangs", "gone"])
def test_a_collector_that_hangs_or_is_gone_changes_nothing_for_the_call(server, store_dir, collector):
    """The OTLP endpoint accepts and never answers, or nothing listens there: the caller is answered, the
    booking is made, the call ends as it would, and the worker counts what it could not send on /metrics."""
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(silent_listener()) if collector == "hangs" else closed_port()
        prometheus = closed_port()
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "CHORUS_PROMETHEUS_PORT": str(prometheus),
        }
        worker = stack.enter_context(Worker(server, store_dir, slots=2, **env))
        t0 = time.monotonic()
        booking_call(server, worker, store_dir)
        answered_in = time.monotonic() - t0
        wait_until(lambda: "call ended" in worker.log.read_text(errors="replace"), "the call's end", 60)

        def lost() -> float:
            with urllib.request.urlopen(f"http://127.0.0.1:{prometheus}/metrics", timeout=5) as r:
                text = r.read().decode()
            found = re.findall(r'^chorus_trace_spans_dropped_total\{reason="\w+"\} (\S+)$', text, re.M)
            return sum(float(v) for v in found)

        wait_until(lambda: lost() >= 1, "the worker's lost spans counted", 30, every=0.5)
        log = worker.log.read_text(errors="replace")
    assert any(r[0] == "Test Rowan" and r[2] == "confirmed" for r in booking_rows(store_dir)), booking_rows(
        store_dir
    )
    ended = [line for line in log.splitlines() if "call ended" in line]
    assert len(ended) == 1 and re.search(r"call ended, the participant-\w+ left", ended[0]), (
        ended
    )  # by the caller
    assert answered_in < 60
