"""Tracing's configuration, as OpenTelemetry is configured everywhere: the standard `OTEL_*` variables (read
over `.env`), off when no OTLP endpoint is set.

The settings are envsettings/traces.py's `TraceSettings`, which the engine's process is given too, with its
config (`engine_variables`). `configure(role)` gives this process (the worker, a room's) a tracer provider:
spans in the job's trace (agent/tracing.py `JobIds`, `AdoptJobRoots`), livekit-agents' own spans on the same
provider with its personal fields stripped (`telemetry.set_tracer_provider(..., allow_pii=False)`), and every
span sent through `BoundedExport` (envsettings/traces.py): a queue of at most OTEL_BSP_MAX_QUEUE_SIZE spans
that one thread of its own empties into the OTLP exporter with a short timeout. A collector that is down,
slow or refusing costs a call nothing: a span that finds the queue full, or whose export failed, is dropped
and counted (`chorus_trace_spans_dropped_total` on the worker's Prometheus port); nothing on a room's loop or
the tick ever waits on the exporter. Before it leaves, a span is redacted as the log is (`RedactingExporter`,
agent/log_privacy.py `scrub`): rooms and participants as their labels, names redacted, phone numbers masked,
in names of spans, attributes, events and links. Knows OpenTelemetry's SDK and OTLP exporters; nothing of a
call.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Status, StatusCode

from agent import tracing
from agent.log_privacy import CALLER_DATA_MASK, PII, scrub
from envsettings.traces import BoundedExport, TraceSettings

__all__ = [
    "BoundedExport",
    "TraceSettings",
    "build_provider",
    "configure",
    "engine_variables",
    "flush",
    "install",
    "redact",
]

log = logging.getLogger("chorus.agent.telemetry")
TRACE_ID = re.compile(r"[0-9a-f]{32}")  # an OpenTelemetry trace id as 32 hex digits


def _clean(key: str, value: Any) -> Any:
    """An attribute's value as the log would carry a field of that name (`scrub`: `chorus.job_id` as `job_id`,
    livekit-agents' personal `lk.pii.*` as they are named), its text with known names as labels. A trace id
    (`chorus.previous.trace_id`) leaves whole, as the log's `trace_id`: random hex, whose digits are no one's
    number."""
    name = key if key.startswith(PII) else key.rpartition(".")[2]
    if name == "trace_id" and isinstance(value, str) and TRACE_ID.fullmatch(value):
        return value
    if isinstance(value, str):  # the names first: a masked number would hide the room's name it is part of
        value = CALLER_DATA_MASK.free_text(value)
    elif isinstance(value, list | tuple):
        value = [CALLER_DATA_MASK.free_text(x) if isinstance(x, str) else x for x in value]
    return scrub(name, value)


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


def build_provider(exporter: SpanExporter, role: str, settings: TraceSettings) -> TracerProvider:
    """A provider whose spans go, redacted, through a `BoundedExport` to `exporter`; ids of a job's trace."""
    provider = TracerProvider(
        sampler=settings.make_sampler(), resource=settings.resource(role), id_generator=tracing.JobIds()
    )
    provider.add_span_processor(tracing.AdoptJobRoots())
    provider.add_span_processor(settings.bounded(RedactingExporter(exporter)))
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


def engine_variables() -> dict[str, str]:
    """The `OTEL_*` settings as `configure` reads them (the environment over `.env`), by variable name: what
    the engine's process is given with its config (`EngineConfig.traces`), so a setting in `.env` alone
    reaches the engine's spans too. SettingsError when one is bad (the worker has refused it at start)."""
    return TraceSettings.from_env().variables()


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
    provider = build_provider(settings.otlp_exporter(), role, settings)
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
