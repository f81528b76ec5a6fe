"""Tracing's settings, read once for every process of a worker: the OpenTelemetry SDK's own `OTEL_*` variables
(`TraceSettings`, over `.env` as every Chorus setting), off when no OTLP endpoint is set, and the bounded
export they configure (`BoundedExport`).

The worker reads them (agent/telemetry.py), its rooms' processes read them alike, and the engine's process is
given the worker's with its config (`TraceSettings.variables`, `TraceSettings.from_variables`:
engine/observe/spans.py), so one `.env` reaches all three. A process's spans go through a `BoundedExport`: a
queue of at most OTEL_BSP_MAX_QUEUE_SIZE spans that one thread of its own empties into the OTLP exporter,
each export bounded by OTEL_BSP_EXPORT_TIMEOUT. A span that finds the queue full, or whose export failed, is
dropped and counted on the process's own Prometheus registry (`chorus_trace_spans_dropped_total{reason}`,
`chorus_trace_spans_exported_total`): the worker's `/metrics` and the engine's. Nothing that ends a span ever
waits on the exporter. Knows OpenTelemetry's SDK and OTLP exporters and Prometheus' client; nothing of a call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, Self

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, sampling
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import Counter
from pydantic import Field, ValidationError

from envsettings import EnvSettings, SettingsError, _one_line, whole

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

    @classmethod
    def from_variables(cls, variables: Mapping[str, Any]) -> Self:
        """The settings from `variables` by their names (`variables()` of another process's settings, or an
        environment: names not among these settings' are left out); SettingsError on the first bad value."""
        names = {f.validation_alias for f in cls.model_fields.values()}
        values = {k: str(v).strip() for k, v in variables.items() if k in names and str(v).strip()}
        try:
            return cls(**values)
        except ValidationError as e:
            raise SettingsError(_one_line(cls, e)) from None

    def variables(self) -> dict[str, str]:
        """The settings given a value other than their default, by variable name, as `from_variables` reads
        them back (what travels to the engine's process with its config)."""
        fields = type(self).model_fields
        return {
            str(fields[k].validation_alias): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in self.model_dump(exclude_defaults=True).items()
        }

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

    def otlp_exporter(self) -> SpanExporter:
        """The OTLP exporter these settings name, each export bounded by OTEL_BSP_EXPORT_TIMEOUT."""
        timeout = self.export_timeout_ms / 1000
        if self.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=self.traces_endpoint or self.endpoint, timeout=timeout)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        # the SDK's rule: the traces endpoint as it is; the general one with /v1/traces after it
        url = self.traces_endpoint or self.endpoint.rstrip("/") + "/v1/traces"
        return Http(endpoint=url, timeout=timeout)

    def bounded(self, exporter: SpanExporter) -> BoundedExport:
        """A `BoundedExport` to `exporter` with these settings' queue, batch and delay."""
        return BoundedExport(
            exporter,
            max_queue=self.max_queue_size,
            batch=self.max_export_batch_size,
            delay_s=self.schedule_delay_ms / 1000,
        )


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
