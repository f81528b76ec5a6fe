"""The engine's side of a call's trace (engine/observe/spans.py): a session opened with its call's traceparent
gets, as children of that traceparent, its admission, its prompt's prefill, the model writing a tool call, the
result's prefill and the replay, each with its ticks and its bucket's device time from the tick's ledger, read
off the tick thread; a session without a trace gets none, and tracing is off without an OTLP endpoint. Real
engine (tiny preset, dummy weights), ticks driven by hand, the tool call teacher-forced."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.api import FunctionCall
from engine.observe.spans import SessionSpans, make_provider, start_spans
from engine_support import CALL, drain, engine_on, run_ticks
from testkit.concierge import PROMPT, TOOLS

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def test_a_traced_sessions_phases_are_spans_under_its_calls_traceparent():
    engine = engine_on(num_slots=2, cuda_graph=False, tool_timeout_s=3600)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    spans = SessionSpans(engine, provider)
    try:
        traced = engine.open_session(PROMPT, TOOLS, label="room_t", trace=f"00-{TRACE}-{PARENT_SPAN}-01")
        engine.open_session(PROMPT, TOOLS, label="room_u")  # no trace: no spans
        spans.poll()
        k = run_ticks(engine, engine.tick + 1, 3)
        spans.poll()
        traced.force_function(engine.tokens.call_ids(CALL))
        k = run_ticks(engine, k, 3)
        spans.poll()
        call = next(o for o in drain(traced) if isinstance(o, FunctionCall))
        traced.submit_tool_result(call.call_id, json.dumps({"available": True}))
        for _ in range(6):
            k = run_ticks(engine, k, 1)
            spans.poll()
        traced.close()
        spans.poll()
        got = memory.get_finished_spans()
    finally:
        engine.close()
        provider.shutdown()
    names = [s.name for s in got]
    print([(s.name, dict(s.attributes), (s.end_time - s.start_time) / 1e6) for s in got])
    assert names[:2] == ["chorus.engine.admission", "chorus.engine.prompt_prefill"]
    for name in ("chorus.engine.tool_call", "chorus.engine.result_prefill", "chorus.engine.replay"):
        assert name in names, name
    assert names.index("chorus.engine.tool_call") < names.index("chorus.engine.result_prefill")
    for s in got:  # every one a child of the room's span, in the call's trace
        assert f"{s.context.trace_id:032x}" == TRACE and f"{s.parent.span_id:016x}" == PARENT_SPAN
        assert s.end_time >= s.start_time
    by = {s.name: s for s in got}
    prompt = by["chorus.engine.prompt_prefill"]
    assert prompt.attributes["chorus.engine.ticks"] >= 1 and prompt.attributes["chorus.engine.pieces"] >= 1
    assert prompt.attributes["chorus.engine.bucket_device_ms"] > 0
    ms = (prompt.end_time - prompt.start_time) / 1e6
    assert abs(ms - prompt.attributes["chorus.engine.ticks"] * engine.tick_ms) < 1.0
    assert by["chorus.engine.admission"].attributes["chorus.engine.slot"] == traced.slot
    text = json.dumps([dict(s.attributes) for s in got])
    assert "room_t" not in text and "room_u" not in text


def test_tracing_is_off_without_an_endpoint():
    engine = engine_on(num_slots=1, cuda_graph=False)
    try:
        assert make_provider({}) is None and start_spans(engine, {}) is None
        on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
        assert make_provider({**on, "OTEL_SDK_DISABLED": "true"}) is None
        assert make_provider({**on, "OTEL_TRACES_EXPORTER": "none"}) is None
        provider = make_provider({**on, "OTEL_SERVICE_NAME": "hotel-a"})
        assert provider is not None
        attrs = provider.resource.attributes
        assert attrs["service.name"] == "hotel-a" and attrs["chorus.process"] == "engine"
        provider.shutdown()
    finally:
        engine.close()


def test_with_an_endpoint_the_spans_run_on_a_thread_of_their_own_and_stop_with_the_engine():
    engine = engine_on(num_slots=1, cuda_graph=False)
    try:
        spans = start_spans(engine, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
        assert spans is not None and spans._thread.is_alive()
        assert spans._thread is not threading.current_thread()
        spans.close()
        assert not spans._thread.is_alive()
    finally:
        engine.close()


def test_the_engines_process_sends_a_sessions_spans_to_the_collector(monkeypatch, tmp_path):
    """Through the engine's own process (engine/door/serve.py, its tick thread running) and a collector of
    the test's that takes OTLP/HTTP, named in `.env` alone (not in the environment): the worker's settings
    reach the engine's process with its config, and a room's session opened with its call's traceparent has
    its admission and its prompt's prefill sent, in the call's trace, children of the room's span, with the
    engine's resource."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agent import telemetry
    from engine.client.process import EngineProcess
    from engine.client.remote import RemoteEngine
    from engine.config.engine_config import EngineConfig

    bodies: list[bytes] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in telemetry.TraceSettings.model_fields.values():
        monkeypatch.delenv(str(name.validation_alias), raising=False)
    dotenv = (
        f"OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{server.server_port}\nOTEL_BSP_SCHEDULE_DELAY=50\n"
    )
    (tmp_path / ".env").write_text(dotenv)
    with monkeypatch.context() as m:  # the worker's directory, with its .env
        m.chdir(tmp_path)
        traces = telemetry.engine_variables()  # as the worker gives them to its engine (agent/worker.py)

    def spans() -> dict[str, tuple]:
        out = {}
        for body in list(bodies):
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out[s.name] = (s.trace_id.hex(), s.parent_span_id.hex(), resource)
        return out

    config = EngineConfig(preset="tiny", num_slots=2, traces=traces)
    process = EngineProcess(config.model_dump_json(), timeout=180).start()
    try:

        async def main():
            room = RemoteEngine(process.address, key=process.keys.room)
            handle = room.open_session(PROMPT, TOOLS, trace=f"00-{TRACE}-{PARENT_SPAN}-01")
            deadline = time.monotonic() + 90
            while "chorus.engine.prompt_prefill" not in spans() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            handle.close()

        asyncio.run(main())
    finally:
        process.stop()
        server.shutdown()
    got = spans()
    print({name: v[:2] for name, v in got.items()})
    for name in ("chorus.engine.admission", "chorus.engine.prompt_prefill"):
        trace_id, parent, resource = got[name]
        assert (trace_id, parent) == (TRACE, PARENT_SPAN), name
        assert resource["chorus.process"] == "engine" and resource["service.name"] == "chorus"


def dropped(reason: str) -> float:
    """`chorus_trace_spans_dropped_total{reason}` as this process's /metrics serves it (the engine's: its
    snapshot server sends this registry, engine/observe/metrics.py)."""
    from prometheus_client import REGISTRY, generate_latest

    text = generate_latest(REGISTRY).decode()
    found = re.findall(rf'^chorus_trace_spans_dropped_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(found[0]) if found else 0.0


def test_the_engines_spans_a_collector_refused_are_counted_on_its_metrics():
    """A collector that answers every export with an error: the engine's spans of a traced session are
    dropped, each counted as `export_failed` on the engine's /metrics, and the session serves on."""
    posts: list[int] = []

    class Refusing(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            posts.append(1)
            self.send_response(400)  # not to be tried again
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = engine_on(num_slots=1, cuda_graph=False)
    before = dropped("export_failed")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        spans = start_spans(engine, {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "20"})
        assert spans is not None
        traced = engine.open_session(PROMPT, TOOLS, label="room_t", trace=f"00-{TRACE}-{PARENT_SPAN}-01")
        spans.poll()
        run_ticks(engine, engine.tick + 1, 3)
        spans.poll()
        traced.close()
        spans.close()  # what is queued is sent (and refused) before it returns
    finally:
        engine.close()
        server.shutdown()
    assert posts, "the collector was never asked"
    assert dropped("export_failed") - before >= 2  # the session's admission and its prompt's prefill
