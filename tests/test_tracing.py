"""A call's trace without a collector: the spans a call makes (agent/call_trace.py) in its job's trace
(agent/tracing.py), read back from an in-memory exporter behind the same bounded, redacting export the
worker uses (agent/telemetry.py); the settings read from OTEL_*; a collector that hangs costs a span's end
nothing and its drops are counted on /metrics; the trace id on a call's log lines."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from agent import telemetry, tracing
from agent.call_trace import CallTrace
from engine.api import FunctionCall, ToolCallStarted, ToolResultConsumed, TurnEnded, TurnStarted
from envsettings import SettingsError
from tracing_support import exported_spans

SETTINGS = telemetry.TraceSettings(endpoint="http://127.0.0.1:9", schedule_delay_ms=20)


@pytest.fixture
def spans():
    """Chorus's spans, sent through the worker's export (redacted, bounded) to memory; finished spans by
    name once `read()` is called."""
    with exported_spans(SETTINGS) as read:
        yield read


def by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_the_job_and_its_call_share_one_trace_and_the_call_is_the_jobs_child(spans):
    """The worker's span of a job and the room's call span, made with nothing passed between them but the
    job's id, are one trace: the call's parent is the job's span, whose traceparent the room derives."""
    with tracing.job_scope("AJ_one", root=True):
        job = tracing.tracer().start_span(tracing.JOB_SPAN)
    job.end()
    call = CallTrace("AJ_one", room="room-x")
    call.end("the caller left")
    other = CallTrace("AJ_two")
    other.end("the caller left")
    got = by_name(spans())
    (job,) = got[tracing.JOB_SPAN]
    first, second = sorted(got["chorus.call"], key=lambda s: s.attributes["chorus.job_id"])
    assert job.context.trace_id == first.context.trace_id == tracing.job_trace_id("AJ_one")
    assert job.context.span_id == tracing.job_span_id("AJ_one") == first.parent.span_id
    assert second.context.trace_id != first.context.trace_id
    parent = tracing.job_traceparent("AJ_one").split("-")
    assert parent[1] == f"{job.context.trace_id:032x}" and parent[2] == f"{job.context.span_id:016x}"
    assert parent[3] == "01"  # sampled, as the worker's sampler decided
    assert first.attributes["chorus.end_reason"] == "the caller left"


def test_a_calls_turns_and_tool_calls_are_its_children_with_their_times(spans):
    """A turn carries its mouth-to-ear figure; a tool call its model's, tool's and prefill's times (the
    children's durations), its outcome and the engine's own figures; all under the call's span."""
    call = CallTrace("AJ_call")
    call.opening()
    time.sleep(0.02)
    call.opened()
    call.first_frame()
    voiced = time.monotonic()
    time.sleep(0.03)
    call.event(TurnStarted(tick=1), voiced)
    time.sleep(0.02)
    call.event(ToolCallStarted(tick=2))
    time.sleep(0.03)
    call.event(FunctionCall(tick=3, call_id="c1", name="book_room", arguments='{"name": "Grace Hopper"}'))
    time.sleep(0.04)
    call.result("c1", is_error=False)
    time.sleep(0.05)
    call.event(ToolResultConsumed(tick=9, call_ms=31.0, resume_ms=52.0))
    call.event(TurnStarted(tick=10), -1e9)
    call.event(TurnEnded(tick=11))
    call.end("the caller left")
    got = by_name(spans())
    (root,) = got["chorus.call"]
    for name in ("chorus.session.admit", "chorus.first_frame", "chorus.turn", "chorus.tool_call"):
        assert all(s.parent.span_id == root.context.span_id for s in got[name]), name
    first, second = sorted(got["chorus.turn"], key=lambda s: s.start_time)
    assert 25 <= first.attributes["chorus.mouth_to_ear_ms"] < 1000
    assert "chorus.mouth_to_ear_ms" not in second.attributes  # a caller quiet for long: no answer to time
    assert first.end_time <= got["chorus.tool_call"][0].start_time  # the call cut the turn
    (tool,) = got["chorus.tool_call"]
    a = tool.attributes
    assert (a["chorus.tool"], a["chorus.call_id"], a["chorus.outcome"]) == ("book_room", "c1", "ok")
    assert (a["chorus.engine.call_ms"], a["chorus.engine.resume_ms"]) == (31.0, 52.0)
    parts = {n: got[n][0] for n in ("chorus.tool.model", "chorus.tool.run", "chorus.tool.prefill")}
    for name, key in (("chorus.tool.model", "model_ms"), ("chorus.tool.run", "tool_ms")):
        assert parts[name].parent.span_id == tool.context.span_id
        assert abs((parts[name].end_time - parts[name].start_time) / 1e6 - a[f"chorus.{key}"]) < 0.1
    assert a["chorus.model_ms"] >= 25 and a["chorus.tool_ms"] >= 35 and a["chorus.prefill_ms"] >= 45
    # in order: the model's tokens, the tool, the prefill
    order = [parts[n] for n in ("chorus.tool.model", "chorus.tool.run", "chorus.tool.prefill")]
    assert all(x.end_time <= y.start_time for x, y in zip(order, order[1:], strict=False))
    assert "Grace" not in json.dumps([dict(s.attributes) for s in spans()])  # the arguments never go


def test_an_unanswered_tool_call_is_closed_with_the_call(spans):
    call = CallTrace("AJ_gone")
    call.event(ToolCallStarted(tick=1))
    call.event(FunctionCall(tick=2, call_id="c9", name="find_rooms", arguments="{}"))
    call.end("the caller left")
    (tool,) = by_name(spans())["chorus.tool_call"]
    assert tool.attributes["chorus.outcome"] == "unanswered" and not tool.status.is_ok


def test_tracing_is_off_without_an_endpoint_and_a_bad_setting_is_one_clear_error(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not telemetry.TraceSettings.from_env(dotenv=False).on
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert telemetry.TraceSettings.from_env(dotenv=False).on
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not telemetry.TraceSettings.from_env(dotenv=False).on
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "lots")
    with pytest.raises(SettingsError, match="^OTEL_BSP_MAX_QUEUE_SIZE=lots: must be a whole number"):
        telemetry.TraceSettings.from_env(dotenv=False)
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(SettingsError, match="^OTEL_EXPORTER_OTLP_PROTOCOL=carrier-pigeon"):
        telemetry.TraceSettings.from_env(dotenv=False)
    telemetry.install(None)  # no provider: a call's trace makes nothing
    assert not tracing.enabled() and CallTrace("AJ_off").trace_id == ""


class Hanging(SpanExporter):
    """A collector that takes a batch and never answers (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches = 0

    def export(self, spans):
        self.batches += 1
        self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("chorus_trace_spans_dropped_total", {"reason": reason}) or 0.0


def test_a_hanging_collector_never_holds_a_span_and_its_drops_are_counted():
    """A collector that never answers: ending a span stays as quick as ever, the queue holds at most its
    bound, and each span beyond it (and each whose export failed) is counted on the Prometheus figures."""
    hanging = Hanging()
    export = telemetry.BoundedExport(hanging, max_queue=50, batch=10, delay_s=0.01)
    provider = telemetry.build_provider(InMemorySpanExporter(), "test", SETTINGS)
    provider.add_span_processor(export)
    tracer = provider.get_tracer("t")
    full, failed = dropped("queue_full"), dropped("export_failed")
    try:
        tracer.start_span("first").end()
        deadline = time.monotonic() + 10
        while hanging.batches == 0 and time.monotonic() < deadline:  # the first batch is out, and held
            time.sleep(0.01)
        assert hanging.batches == 1
        worst = 0.0
        for i in range(500):
            t0 = time.perf_counter()
            tracer.start_span(f"s{i}").end()
            worst = max(worst, time.perf_counter() - t0)
        assert worst < 0.25  # the export thread is stuck; a span's end is not
        assert len(export._queue) <= 50
        assert dropped("queue_full") - full >= 450
        hanging.release.set()  # the collector answers, refusing: that batch is counted as lost
        deadline = time.monotonic() + 10
        while dropped("export_failed") - failed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped("export_failed") - failed >= 1
    finally:
        hanging.release.set()
        provider.shutdown()
        export.shutdown()


def test_a_calls_log_lines_carry_its_trace_id_past_the_caller_data_mask(spans):
    """Within a job (the worker's handling of its request, or the room's process), every record carries the
    call's trace id as a field, unchanged by the log's mask of numbers (agent/log_privacy.py)."""
    from agent.log_privacy import CallerDataMask

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s trace=%(trace_id)s"))
    handler.addFilter(CallerDataMask())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        tracing.trace_log_handlers()
        # a job id whose trace id has a run of seven digits: what the mask takes for a phone number
        job = next(f"AJ_{i}" for i in range(100000) if _has_digit_run(tracing.job_trace_id(f"AJ_{i}")))
        with tracing.job_scope(job):
            logging.getLogger("chorus.test").warning("job %s: call ended", job)
    finally:
        root.removeHandler(handler)
    assert out.getvalue().strip().endswith(f"trace={tracing.trace_id_hex(tracing.job_trace_id(job))}")


def _has_digit_run(trace_id: int) -> bool:
    import re

    return re.search(r"\d{7}", tracing.trace_id_hex(trace_id)) is not None


def test_a_call_carried_on_after_a_fault_links_to_the_first_calls_trace_with_the_silence(spans):
    """A new agent's call (another job, so another trace) links to the trace of the call it carries on, with
    the re-dispatch's reason; the silence its caller met, from the old agent's last words to the new
    session's first frame, is on the new call's span."""
    from agent.fleet.carry import Conversation

    first = CallTrace("AJ_lost")
    first.end("the room closed")
    kept = Conversation.from_json(Conversation("AJ_lost", last_job="AJ_lost", saved_at=time.time()).to_json())
    assert kept is not None and kept.last_job == "AJ_lost" and kept.saved_at > 0  # as the new job reads it
    time.sleep(0.05)
    second = CallTrace("AJ_new")
    second.carried_on(kept.last_job, "agent lost", 1, kept.saved_at)
    second.opening()
    second.first_frame()
    second.end("the caller left")
    calls = {s.attributes["chorus.job_id"]: s for s in by_name(spans())["chorus.call"]}
    old, new = calls["AJ_lost"], calls["AJ_new"]
    assert new.context.trace_id != old.context.trace_id
    (link,) = new.links
    assert link.context.trace_id == old.context.trace_id and link.context.span_id == old.parent.span_id
    assert link.attributes["chorus.redispatch_reason"] == "agent lost"
    assert new.attributes["chorus.previous.trace_id"] == tracing.trace_id_hex(old.context.trace_id)
    assert 45 <= new.attributes["chorus.silence_ms"] < 5000


def test_the_example_env_file_names_every_trace_setting_and_its_values_are_accepted(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    example = (Path(__file__).resolve().parent.parent / ".env.example").read_text()
    named = set(re.findall(r"^([A-Z_]+)=", example, flags=re.M))
    assert {f.validation_alias for f in telemetry.TraceSettings.model_fields.values()} <= named
    for name in named:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(example)
    monkeypatch.chdir(tmp_path)
    settings = telemetry.TraceSettings.from_env()
    assert not settings.on and settings.max_queue_size == 2048  # off until an endpoint is named
    (tmp_path / ".env").write_text(
        example.replace("OTEL_EXPORTER_OTLP_ENDPOINT=\n", "OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318\n")
        .replace("OTEL_TRACES_SAMPLER=parentbased_always_on", "OTEL_TRACES_SAMPLER=parentbased_traceidratio")
        .replace("OTEL_TRACES_SAMPLER_ARG=\n", "OTEL_TRACES_SAMPLER_ARG=0.25\n")
        .replace("OTEL_RESOURCE_ATTRIBUTES=\n", "OTEL_RESOURCE_ATTRIBUTES=deployment.environment=staging\n")
    )
    settings = telemetry.TraceSettings.from_env()
    assert settings.on and "0.25" in settings.make_sampler().get_description()
    assert settings.resource("room").attributes["deployment.environment"] == "staging"
    # the room's process and the worker decide alike for one job: the same trace id, the same sampler
    provider = telemetry.build_provider(InMemorySpanExporter(), "test", settings)
    telemetry.install(provider)
    try:
        kept = [j for j in (f"AJ_{i}" for i in range(400)) if tracing.job_sampled(j)]
        assert 40 < len(kept) < 160  # about a quarter of the calls
        for job in kept[:5] + [f"AJ_{i}" for i in range(5)]:
            with tracing.job_scope(job, root=True):
                span = tracing.tracer().start_span(tracing.JOB_SPAN)
            assert span.get_span_context().trace_flags.sampled == tracing.job_sampled(job)
            span.end()
    finally:
        telemetry.install(None)
        provider.shutdown()
