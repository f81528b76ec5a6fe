"""The engine's side of a call's trace: each traced session's admission and the phases it passes through off
the live batch (its prompt's prefill, the model writing a tool call, the result's prefill, the replay of the
caller's held audio), as spans under the traceparent its room sent with the session's open
(engine/transport/wire.py `trace_error`), with the ticks each took and the device time of its bucket in the
tick's ledger (engine/tick/ledger.py) over them.

Runs in the engine's process on a thread of its own (`SessionSpans`), never on the tick: every POLL_S it reads
each traced session's last moves between phases and the ticks they happened in (`Session.moves`, which the
tick appends to as it moves the session; one copy, a call the tick thread cannot interleave), and, for a phase
that ended, one copy of the ledger's last ticks. A span's times come from its ticks (`tick_ms` each, counted
back from the tick running now), so they are exact to the tick whenever the poll reads them. The provider is
made from the standard `OTEL_*` settings as the worker reads them (envsettings/traces.py `TraceSettings`:
endpoint, protocol, service name, resource attributes, sampler, queue), off when no OTLP endpoint is set:
then no thread runs. Its spans go through the same bounded export as the worker's (`BoundedExport`): at most
OTEL_BSP_MAX_QUEUE_SIZE queued, a span beyond it or whose export failed dropped and counted on the engine's
/metrics (`chorus_trace_spans_dropped_total{reason}`); nothing of the tick waits on it. Spans carry ids,
phases and counts, never a label or a word. Knows OpenTelemetry's SDK.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from engine.session_phase import Phase
from engine.transport.wire import TRACEPARENT
from envsettings.traces import TraceSettings

log = logging.getLogger("chorus.engine.spans")

POLL_S = 0.25  # how often the sessions' phases are read
TRACER = "chorus.engine"
# the phases spans are made of: the span's name and the phase's bucket in the tick's ledger (SIDE_KINDS)
PHASES = {
    Phase.PROMPT: ("chorus.engine.prompt_prefill", "prompt"),
    Phase.TOOL_CALL: ("chorus.engine.tool_call", "call"),
    Phase.PREFILL: ("chorus.engine.result_prefill", "result"),
    Phase.REPLAY: ("chorus.engine.replay", "replay"),
}


class Session(Protocol):
    id: str
    slot: int
    moves: Any  # its last moves between phases: (phase, tick) each, in order
    opened_at: float
    trace: str


class Traced(Protocol):
    """What the spans read of the engine (engine/tick/engine.py `Engine`)."""

    pool: Any  # .sessions: the open sessions by slot
    ticker: Any  # .ledger.ticks: the last ticks' records (tick, pieces: kind, device_ms)
    clock: Callable[[], float]
    tick: int
    tick_ms: float


def make_provider(
    variables: Mapping[str, Any], exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """The engine process's tracer provider from the `OTEL_*` settings in `variables` (by variable name), or
    None (tracing off) without an OTLP endpoint, with OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none.
    Its spans go to `exporter` (a test's), or to the OTLP exporter the settings name. SettingsError when one
    is bad."""
    settings = TraceSettings.from_variables(variables)
    if not settings.on:
        return None
    provider = TracerProvider(sampler=settings.make_sampler(), resource=settings.resource("engine"))
    provider.add_span_processor(settings.bounded(exporter or settings.otlp_exporter()))
    return provider


def parent_context(traceparent: str) -> trace.Context | None:
    """The OpenTelemetry context whose span is the room's `traceparent` (None for "" or a malformed one)."""
    m = TRACEPARENT.fullmatch(traceparent)
    if m is None:
        return None
    flags = TraceFlags(int(traceparent[-2:], 16) & TraceFlags.SAMPLED)
    ctx = SpanContext(int(m[1], 16), int(m[2], 16), is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(ctx)) if ctx.is_valid else None


class SessionSpans:
    """The spans of `engine`'s traced sessions, sent to `provider`; `start()` polls on a thread of its own,
    `poll()` is one reading (the thread's, or a test's)."""

    def __init__(self, engine: Traced, provider: TracerProvider, poll_s: float = POLL_S) -> None:
        self.engine, self.provider, self.poll_s = engine, provider, poll_s
        self.tracer = provider.get_tracer(TRACER)
        self._seen: dict[str, _Seen] = {}  # the traced sessions as last read, by id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chorus-engine-spans", daemon=True)

    def start(self) -> SessionSpans:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.poll()
        self.provider.shutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 (a reading that failed is skipped; the next one reads again)
                log.warning("the engine's spans could not be read this time", exc_info=True)

    def _ns(self, tick: int, now_tick: int, now_ns: int) -> int:
        return now_ns - int((now_tick - tick) * self.engine.tick_ms * 1e6)

    def poll(self) -> None:
        e = self.engine
        now_ns, now_tick, now_clock = time.time_ns(), e.tick, e.clock()
        sessions = {s.id: s for s in list(e.pool.sessions.values()) if s.trace}
        ended: list[tuple[Any, Phase, int, int]] = []  # (parent, phase, from tick, to tick)
        for sid, s in sessions.items():
            seen = self._seen.get(sid)
            if seen is None:
                parent = parent_context(s.trace)
                if parent is None:
                    continue
                age_s = max(0.0, now_clock - s.opened_at)
                at = now_ns - int(age_s * 1e9)
                span = self.tracer.start_span(
                    "chorus.engine.admission",
                    context=parent,
                    start_time=at,
                    attributes={"chorus.engine.session": sid, "chorus.engine.slot": s.slot},
                )
                span.end(end_time=at)
                # it opened in its first phase, at the tick it opened in
                seen = _Seen(parent, Phase.PROMPT, now_tick - int(age_s * 1000 / e.tick_ms))
                self._seen[sid] = seen
            moves = list(s.moves)  # one copy
            at = next((i for i in range(len(moves) - 1, -1, -1) if moves[i] is seen.last), -1)
            for move in moves[at + 1 :]:
                ended.append((seen.parent, seen.phase, seen.since, move[1]))
                seen.phase, seen.since = move
            if moves:
                seen.last = moves[-1]
        for sid in [sid for sid in self._seen if sid not in sessions]:  # closed: its phase ends now
            seen = self._seen.pop(sid)
            ended.append((seen.parent, seen.phase, seen.since, now_tick))
        ended = [x for x in ended if x[1] in PHASES]
        if not ended:
            return
        records = list(e.ticker.ledger.ticks)  # one copy
        for parent, phase, first, b in ended:
            name, bucket = PHASES[phase]
            device = [
                p.device_ms
                for r in records
                if first <= r.tick <= b  # the ticks it entered and left in included: its bucket's pieces
                for p in r.pieces
                if p.kind == bucket and p.device_ms == p.device_ms
            ]
            attrs: dict[str, Any] = {"chorus.engine.ticks": max(0, b - first)}
            if device:
                attrs["chorus.engine.bucket_device_ms"] = round(sum(device), 3)
                attrs["chorus.engine.pieces"] = len(device)
            start = self._ns(first, now_tick, now_ns)
            span = self.tracer.start_span(name, context=parent, start_time=start, attributes=attrs)
            span.end(end_time=max(start, self._ns(b, now_tick, now_ns)))


class _Seen:
    """A traced session as last read: its parent context, its phase and the tick it entered it, and the last
    of its moves read (engine/tick/session.py `Session.moves`)."""

    __slots__ = ("parent", "phase", "since", "last")

    def __init__(self, parent: Any, phase: Phase, since: int) -> None:
        self.parent, self.phase, self.since = parent, phase, since
        self.last: tuple[Phase, int] | None = None


def start_spans(engine: Traced, variables: Mapping[str, Any]) -> SessionSpans | None:
    """The engine's spans on a thread of their own, from the worker's `OTEL_*` settings by variable name
    (`EngineConfig.traces`: the engine reads none of its environment's), or None when tracing is off (no
    endpoint set) or its exporter cannot be made from them (logged: the engine serves its calls untraced)."""
    try:
        provider = make_provider(variables)
    except Exception as e:  # noqa: BLE001 (the worker refuses bad OTEL_* settings first; calls go on untraced)
        log.warning("the engine's spans are off: %s", type(e).__name__)
        return None
    return None if provider is None else SessionSpans(engine, provider).start()
