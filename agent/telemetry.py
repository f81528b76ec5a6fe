"""Tracing's configuration, as OpenTelemetry is configured everywhere: the standard `OTEL_*` variables (read
over `.env`), off when no OTLP endpoint is set.

`configure(role)` gives this process (the worker, a room's) a tracer provider: spans in the job's trace
(agent/tracing.py `JobIds`, `AdoptJobRoots`), livekit-agents' own spans on the same provider with its personal
fields stripped (`telemetry.set_tracer_provider(..., allow_pii=False)`), and every span sent through
`BoundedExport`: a queue of at most OTEL_BSP_MAX_QUEUE_SIZE spans that one thread of its own empties into the
OTLP exporter with a short timeout. A collector that is down, slow or refusing costs a call nothing: a span
that finds the queue full, or whose export failed, is dropped and counted (`chorus_trace_spans_dropped_total`
on the worker's Prometheus port); nothing on a room's loop or the tick ever waits on the exporter. Before it
leaves, a span is redacted as the log is (`RedactingExporter`, agent/log_privacy.py `scrub`): rooms and
participants as their labels, names redacted, phone numbers masked, in names of spans, attributes, events
and links. Knows OpenTelemetry's SDK and OTLP exporters; nothing of a call.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Status, StatusCode
from prometheus_client import Counter
from pydantic import Field

from agent import tracing
from agent.log_privacy import CALLER_DATA_MASK, PII, scrub
from envsettings import EnvSettings, whole

log = logging.getLogger("chorus.agent.telemetry")

SERVICE_NAME = "chorus"  # OTEL_SERVICE_NAME's default
DROPPED = Counter(
    "chorus_trace_spans_dropped",
    "Spans not sent to the trace collector: its queue full (queue_full) or its export failed (export_failed)",
    ["reason"],
)
EXPORTED = Counter("chorus_trace_spans_exported", "Spans the trace collector took")


Sampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]


class TraceSettings(EnvSettings):
    """The OpenTelemetry SDK's own variables, as the SDK reads them but over `.env` too, and refused in one
    line when bad."""

    endpoint: str = Field("", validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT", description="a URL")
    traces_endpoint: str = Field(
        "", validation_alias="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", description="a URL"
    )
    protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf", validation_alias="OTEL_EXPORTER_OTLP_PROTOCOL", description="http/protobuf or grpc"
    )
    exporter: Literal["otlp", "none"] = Field(
        "otlp", validation_alias="OTEL_TRACES_EXPORTER", description="otlp or none"
    )
    disabled: bool = Field(False, validation_alias="OTEL_SDK_DISABLED", description="true or false")
    service_name: str = Field(SERVICE_NAME, validation_alias="OTEL_SERVICE_NAME", description="a name")
    resource_attributes: str = Field(
        "",
        validation_alias="OTEL_RESOURCE_ATTRIBUTES",
        pattern=r"^([^=,]+=[^,]*)?(,[^=,]+=[^,]*)*$",
        description="key=value pairs, comma separated",
    )
    sampler: Sampler = Field(
        "parentbased_always_on",
        validation_alias="OTEL_TRACES_SAMPLER",
        description="one of the SDK's samplers",
    )
    sampler_arg: float = Field(
        1.0, ge=0.0, le=1.0, validation_alias="OTEL_TRACES_SAMPLER_ARG", description="a ratio from 0 to 1"
    )
    max_queue_size: int = whole(2048, 1, 1_000_000, "OTEL_BSP_MAX_QUEUE_SIZE")
    max_export_batch_size: int = whole(512, 1, 1_000_000, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    schedule_delay_ms: int = whole(500, 1, 60_000, "OTEL_BSP_SCHEDULE_DELAY")
    # the SDK's default is 30 s; a collector that hangs would hold each batch that long while the queue drops
    export_timeout_ms: int = whole(2000, 1, 60_000, "OTEL_BSP_EXPORT_TIMEOUT")

    def make_sampler(self) -> sampling.Sampler:
        """The sampler OTEL_TRACES_SAMPLER names (with OTEL_TRACES_SAMPLER_ARG for a ratio)."""
        root = {
            "on": sampling.ALWAYS_ON,
            "off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(self.sampler_arg),
        }[self.sampler.removeprefix("parentbased_").removeprefix("always_")]
        return sampling.ParentBased(root) if self.sampler.startswith("parentbased_") else root

    def resource(self, role: str) -> Resource:
        pairs = [p.split("=", 1) for p in self.resource_attributes.split(",") if "=" in p]
        attributes = {k.strip(): v.strip() for k, v in pairs}
        return Resource.create({**attributes, "service.name": self.service_name, "chorus.process": role})

    @property
    def on(self) -> bool:
        return bool(self.endpoint or self.traces_endpoint) and self.exporter == "otlp" and not self.disabled


def _exporter(settings: TraceSettings) -> SpanExporter:
    timeout = settings.export_timeout_ms / 1000
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=settings.traces_endpoint or settings.endpoint, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    # the SDK's rule: the traces endpoint as it is; the general one with /v1/traces after it
    url = settings.traces_endpoint or settings.endpoint.rstrip("/") + "/v1/traces"
    return Http(endpoint=url, timeout=timeout)


def _clean(key: str, value: Any) -> Any:
    """An attribute's value as the log would carry a field of that name (`scrub`: `chorus.job_id` as `job_id`,
    livekit-agents' personal `lk.pii.*` as they are named), its text with known names as labels."""
    if isinstance(value, str):  # the names first: a masked number would hide the room's name it is part of
        value = CALLER_DATA_MASK.free_text(value)
    elif isinstance(value, list | tuple):
        value = [CALLER_DATA_MASK.free_text(x) if isinstance(x, str) else x for x in value]
    return scrub(key if key.startswith(PII) else key.rpartition(".")[2], value)


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: _clean(k, v) for k, v in (attributes or {}).items()}


def redact(span: ReadableSpan) -> ReadableSpan:
    """`span` as it may leave the process: every attribute (the span's, its events', its links') and its name
    and status as the log would carry them."""
    status = span.status
    if status.status_code is StatusCode.ERROR and status.description:
        status = Status(StatusCode.ERROR, CALLER_DATA_MASK.free_text(status.description))
    return ReadableSpan(
        name=CALLER_DATA_MASK.free_text(span.name),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=_attributes(span.attributes),
        events=[
            Event(CALLER_DATA_MASK.free_text(e.name), _attributes(e.attributes), e.timestamp)
            for e in span.events
        ],
        links=[Link(link.context, _attributes(link.attributes)) for link in span.links],
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class RedactingExporter(SpanExporter):
    """`inner`, sent spans as `redact` has them (in the export thread, never where a span ends)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([redact(s) for s in spans])

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class BoundedExport(SpanProcessor):
    """Sampled spans, as they end, into a queue of at most `max_queue` (a span that finds it full is dropped
    and counted); a thread of its own sends them in batches of `batch` at least every `delay_s`, each export
    bounded by the exporter's own timeout. `on_end` takes a lock held only to append."""

    def __init__(self, exporter: SpanExporter, *, max_queue: int, batch: int, delay_s: float) -> None:
        self.exporter = exporter
        self.max_queue, self.batch, self.delay_s = max_queue, batch, delay_s
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="chorus-trace-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopped or not span.context.trace_flags.sampled:
            return
        with self._lock:
            full = len(self._queue) >= self.max_queue
            if not full:
                self._queue.append(span)
                self._idle.clear()
            waiting = len(self._queue)
        if full:
            DROPPED.labels("queue_full").inc()
        elif waiting >= self.batch:
            self._wake.set()

    def _take(self) -> list[ReadableSpan]:
        with self._lock:
            n = min(self.batch, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._send_all()

    def _send_all(self) -> None:
        while spans := self._take():
            try:
                ok = self.exporter.export(spans) is SpanExportResult.SUCCESS
            except Exception:  # noqa: BLE001 (an exporter that raises loses its batch, never the thread)
                ok = False
            (EXPORTED if ok else DROPPED.labels("export_failed")).inc(len(spans))
        with self._lock:
            if not self._queue:
                self._idle.set()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until every span queued so far was sent (or dropped), at most `timeout_millis`."""
        self._wake.set()
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Send what is queued (at most one export timeout's wait), then stop."""
        self.force_flush(int(1000 * max(self.delay_s, 2.0)))
        self._stopped = True
        self._wake.set()
        self.exporter.shutdown()


def build_provider(exporter: SpanExporter, role: str, settings: TraceSettings) -> TracerProvider:
    """A provider whose spans go, redacted, through a `BoundedExport` to `exporter`; ids of a job's trace."""
    provider = TracerProvider(
        sampler=settings.make_sampler(), resource=settings.resource(role), id_generator=tracing.JobIds()
    )
    provider.add_span_processor(tracing.AdoptJobRoots())
    export = BoundedExport(
        RedactingExporter(exporter),
        max_queue=settings.max_queue_size,
        batch=settings.max_export_batch_size,
        delay_s=settings.schedule_delay_ms / 1000,
    )
    provider.add_span_processor(export)
    return provider


def install(provider: TracerProvider | None) -> None:
    """`provider` for Chorus's spans and livekit-agents' (whose personal fields it strips first), and the
    trace id on the log's lines; None: Chorus's spans off (the framework keeps the provider it had)."""
    tracing.use_provider(provider)
    if provider is None:
        return
    from livekit.agents import telemetry

    telemetry.set_tracer_provider(provider, allow_pii=False)
    tracing.trace_log_handlers()


_configured: dict[int, TracerProvider | None] = {}  # by process id: a forked process configures its own


def configure(role: str, settings: TraceSettings | None = None) -> TracerProvider | None:
    """This process's tracer provider for its `role` (the resource's `chorus.process`: worker, room), made
    once per process; None (tracing off) without an OTLP endpoint. Bad settings raise SettingsError."""
    pid = os.getpid()
    if pid in _configured:
        return _configured[pid]
    settings = TraceSettings.from_env() if settings is None else settings
    if not settings.on:
        _configured[pid] = None
        tracing.use_provider(None)
        return None
    provider = build_provider(_exporter(settings), role, settings)
    install(provider)
    _configured[pid] = provider
    # a room's process ends through multiprocessing, which runs its finalizers but not atexit's: what its
    # job's last spans queued is sent first (bounded by the export timeout)
    multiprocessing.util.Finalize(
        None, provider.force_flush, args=(2 * settings.export_timeout_ms,), exitpriority=1
    )
    log.debug("traces go to %s (%s)", settings.traces_endpoint or settings.endpoint, settings.protocol)
    return provider


def flush(timeout_s: float = 2.0) -> None:
    """Send what this process's spans queued (at most `timeout_s`): a room's process before it ends."""
    provider = _configured.get(os.getpid())
    if provider is not None:
        t0 = time.monotonic()
        provider.force_flush(int(1000 * timeout_s))
        log.debug("spans flushed in %.0f ms", 1000 * (time.monotonic() - t0))
