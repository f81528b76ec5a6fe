"""A call's trace: its id, the tracer Chorus's spans come from, and the trace id on each log line of a call.

One call is one trace, whose id both the worker and the room's process derive from the LiveKit job's id
(`job_trace_id`): the worker's span for the job (`chorus.job`, from the request to its acceptance) has a span
id derived from it too (`job_span_id`), so the room's process, which learns nothing from the worker but its
job, continues that trace from the same W3C traceparent (`job_traceparent`) the worker would send. A call
carried on by another agent after a fault is another job, so another trace, linked to the first
(agent/call_trace.py). livekit-agents' own spans of the job (`job_entrypoint`, `agent_session`, its turns)
start a trace of their own: `JobIds` gives them the job's trace id and `AdoptJobRoots` makes their root a
child of the job's span, so the framework's spans and Chorus's are one tree.

`tracer()` is a no-op tracer until agent/telemetry.py sets a provider (`use_provider`): with tracing off, a
span costs a function call and nothing is sent. Knows OpenTelemetry's API and SDK and livekit-agents' job
context; nothing of a call.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

TRACER_NAME = "chorus"
JOB_SPAN = "chorus.job"  # the worker's span of a job: its parent's id is derived from the job's id

_job: ContextVar[str | None] = ContextVar("chorus_trace_job", default=None)  # the job a worker handles now
_root_span: ContextVar[int | None] = ContextVar("chorus_trace_root_span", default=None)
_provider: trace.TracerProvider | None = None


def use_provider(provider: trace.TracerProvider | None) -> None:
    """The provider Chorus's spans go to from now on (None: none, tracing off)."""
    global _provider
    _provider = provider


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    """Chorus's tracer: the configured provider's, or a no-op one."""
    return (_provider or trace.NoOpTracerProvider()).get_tracer(TRACER_NAME)


def _digest(kind: str, job_id: str, size: int) -> int:
    value = int.from_bytes(hashlib.sha256(f"chorus-{kind}:{job_id}".encode()).digest()[:size], "big")
    return value or 1  # an id of zeros is invalid


def job_trace_id(job_id: str) -> int:
    """The trace id of the call LiveKit job `job_id` runs (128 bits)."""
    return _digest("trace", job_id, 16)


def job_span_id(job_id: str) -> int:
    """The span id of the worker's span of job `job_id` (`JOB_SPAN`): the parent of the call's spans."""
    return _digest("span", job_id, 8)


def job_sampled(job_id: str) -> bool:
    """Whether the job's trace is recorded: the provider's sampler (OTEL_TRACES_SAMPLER) asked about the
    job's root span, as the worker asked it, with the same trace id and so the same answer."""
    if _provider is None:
        return False
    sampler = getattr(_provider, "sampler", None)
    if sampler is None:
        return True
    return sampler.should_sample(None, job_trace_id(job_id), JOB_SPAN).decision.is_sampled()


def job_span_context(job_id: str) -> SpanContext:
    """The worker's span of job `job_id`, as a remote parent."""
    flags = TraceFlags(TraceFlags.SAMPLED if job_sampled(job_id) else TraceFlags.DEFAULT)
    return SpanContext(job_trace_id(job_id), job_span_id(job_id), is_remote=True, trace_flags=flags)


def job_context(job_id: str) -> Context:
    """An OpenTelemetry context whose current span is the worker's span of job `job_id`."""
    return trace.set_span_in_context(NonRecordingSpan(job_span_context(job_id)))


def job_traceparent(job_id: str) -> str:
    """The W3C traceparent of the worker's span of job `job_id`."""
    return traceparent(NonRecordingSpan(job_span_context(job_id)))


def traceparent(span: trace.Span) -> str:
    """The W3C traceparent whose parent is `span` ("" for a span of no trace: tracing off). A room sends its
    call's with the session's open, so the engine's spans of the session join the call's trace."""
    c = span.get_span_context()
    if not c.is_valid:
        return ""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


@contextlib.contextmanager
def job_scope(job_id: str, *, root: bool = False) -> Iterator[None]:
    """Within: spans started without a parent belong to job `job_id`'s trace (`JobIds`), log lines carry its
    trace id, and with `root` the span started next is the job's own span (`job_span_id`)."""
    tokens = (_job.set(job_id), _root_span.set(job_span_id(job_id) if root else None))
    try:
        yield
    finally:
        _root_span.reset(tokens[1])
        _job.reset(tokens[0])


def current_job() -> str | None:
    """The job this code runs for: the worker's `job_scope`, or the livekit-agents job whose context this is
    (a room's process, or a job's thread in the worker's)."""
    job = _job.get()
    if job is not None:
        return job
    try:
        from livekit.agents import get_job_context

        return get_job_context().job.id
    except (RuntimeError, ImportError, AttributeError):
        return None


class JobIds(IdGenerator):
    """Random ids, but for a span with no parent started for a job: its trace id is the job's, and the
    worker's span of a job (`job_scope(root=True)`) has the job's span id."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        root = _root_span.get()
        if root is not None:
            _root_span.set(None)
            return root
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        job = current_job()
        return job_trace_id(job) if job else self._random.generate_trace_id()


class AdoptJobRoots(SpanProcessor):
    """In a room's process: a span that starts with no parent in its job's trace (livekit-agents' root,
    `job_entrypoint`) becomes a child of the worker's span of the job, so the trace is one tree."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.parent is not None or span.name == JOB_SPAN:
            return
        job = current_job()
        if job and span.context.trace_id == job_trace_id(job):
            span._parent = job_span_context(job)  # noqa: SLF001 (set before anything reads it; the SDK's own field)


class TraceIdFilter(logging.Filter):
    """Puts the call's trace id on each record logged for a job (`trace_id`, as a field: the worker's JSON log
    prints it), or the current span's where there is one; none while tracing is off."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _provider is None or getattr(record, "trace_id", None):
            return True
        job = current_job()
        if job:
            record.trace_id = trace_id_hex(job_trace_id(job))
        else:
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = trace_id_hex(ctx.trace_id)
        return True


TRACE_ID_FILTER = TraceIdFilter()


def trace_log_handlers() -> None:
    """Put `TRACE_ID_FILTER` on every handler of the root logger that lacks it, before any other filter (the
    caller-data mask, agent/log_privacy.py, then sees the field). Safe to call again."""
    for handler in logging.getLogger().handlers:
        if TRACE_ID_FILTER not in handler.filters:
            handler.filters.insert(0, TRACE_ID_FILTER)
