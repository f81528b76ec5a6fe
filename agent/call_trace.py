"""One call's spans, in the call's trace (agent/tracing.py): `chorus.call` from the job's start in the room's
process to the call's end, the child of the worker's `chorus.job`, and under it

- `chorus.room.join`: the room joined; `chorus.caller.wait`: until the caller is there;
- `chorus.session.admit`: the engine's session asked for until the engine opened it (or refused it);
- `chorus.first_frame`: the session asked for until its first frame reached the room (its prompt's prefill);
- `chorus.turn`: each agent turn, with `chorus.mouth_to_ear_ms` (the caller's last loud frame to the turn's
  first frame in the room), `chorus.barge_in` and its frames;
- `chorus.tool_call`: each tool call, from the pause the model began to the session live again, with its tool
  (`chorus.tool`), `chorus.outcome` (ok, error, rejected, unanswered) and its parts as children and as
  attributes: `chorus.tool.model` (the model's tokens: `chorus.model_ms`), `chorus.tool.run` (the tool:
  `chorus.tool_ms`), `chorus.tool.prefill` (its result prefilled and the held audio replayed:
  `chorus.prefill_ms`), with the engine's own figures (`chorus.engine.call_ms`, `chorus.engine.resume_ms`);
- `chorus.hold_clip`: an acknowledgement or hold clip played while the call waited;
- `chorus.phone.transfer` / `chorus.phone.hangup`: a phone call ended by the agent.

Spans are made from times taken as things happen, on the room's loop (no export there: agent/telemetry.py);
with tracing off every method returns at once. Attributes carry labels, counts and times, never names,
numbers or words. Knows the engine's events and OpenTelemetry's API; nothing of LiveKit's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from agent import tracing
from engine.api import (
    AudioFrame,
    FunctionCall,
    SessionFailed,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
    TurnEnded,
    TurnStarted,
)
from redaction import pseudonym

MOUTH_TO_EAR_MAX_S = 10.0  # a turn whose caller was quiet longer than this was not an answer: no figure

_current: ContextVar[CallTrace | None] = ContextVar("chorus_call_trace", default=None)


def _ns() -> int:
    return time.time_ns()


class _Tool:
    """One tool call's times (ns) as they come."""

    def __init__(self, paused: int, called: int, call_id: str, name: str) -> None:
        self.paused, self.called, self.call_id, self.name = paused, called, call_id, name
        self.answered: int | None = None
        self.is_error = False


class CallTrace:
    """The spans of one call (see the module's docstring). `job`: the LiveKit job's id, whose trace this is;
    None: a call with no job (the simulation, tests), traced under a trace of its own."""

    def __init__(self, job: str | None, *, room: str = "", attributes: dict[str, Any] | None = None) -> None:
        self.on = tracing.enabled()
        self.job = job
        self._turn: tuple[int, Span] | None = None
        self._paused_at: int | None = None
        self._tools: list[_Tool] = []
        self._opening_at = 0
        self._first = False
        self._turns = 0
        self._silent_since: float | None = None  # a call carried on: when its last agent last spoke (s)
        self.reason = "the job ended before its call began"  # why the call ended, its job's words
        self.span: Span = trace.INVALID_SPAN
        if not self.on:
            return
        attrs: dict[str, Any] = {"chorus.room_label": pseudonym("room", room) if room else ""}
        if job:
            attrs["chorus.job_id"] = job
        attrs.update(attributes or {})
        parent = tracing.job_context(job) if job else None
        self.span = tracing.tracer().start_span("chorus.call", context=parent, attributes=attrs)
        self._ctx = trace.set_span_in_context(self.span)

    @property
    def trace_id(self) -> str:
        """The call's trace id as 32 hex digits ("" when it is not traced)."""
        c = self.span.get_span_context()
        return tracing.trace_id_hex(c.trace_id) if c.is_valid else ""

    def activate(self) -> None:
        """This call's trace is the one its session (agent/duplex.py, made in this context) reports to."""
        _current.set(self)

    def child(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> Span:
        """A span under the call's, from `start_ns` (ended at `end_ns` when given)."""
        if not self.on:
            return trace.INVALID_SPAN
        span = tracing.tracer().start_span(
            name, context=self._ctx, start_time=start_ns, attributes=attributes
        )
        if end_ns is not None:
            span.end(end_time=end_ns)
        return span

    @contextlib.contextmanager
    def step(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A span under the call's around a block; an exception marks it failed (its type, not its text)."""
        if not self.on:
            yield trace.INVALID_SPAN
            return
        span = self.child(name, _ns(), **attributes)
        try:
            yield span
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            span.end()

    def link(self, context: trace.SpanContext, **attributes: Any) -> None:
        """A link from the call's span (a call carried on: the trace of the call before the fault)."""
        if self.on and context.is_valid:
            self.span.add_link(context, attributes)

    def carried_on(self, previous_job: str, reason: str, breaks: int, saved_at: float) -> None:
        """This call carries on a call its caller had with another agent (a worker's or an engine's death, a
        drain): the call's span links to the trace of `previous_job`'s call, with the re-dispatch's `reason`;
        the silence the caller met, from about when that agent last spoke (`saved_at`, wall clock) to this
        session's first frame, is `chorus.silence_ms` on the call's span."""
        if not self.on or not previous_job:
            return
        attrs = {"chorus.redispatch_reason": reason, "chorus.breaks": breaks}
        self.link(tracing.job_span_context(previous_job), **attrs)
        previous = tracing.trace_id_hex(tracing.job_trace_id(previous_job))
        self.span.set_attributes({**attrs, "chorus.previous.trace_id": previous})
        if math.isfinite(saved_at) and 0 < saved_at <= time.time():
            self._silent_since = saved_at

    # -- the session's side (agent/duplex.py) ---------------------------------------------------------

    def opening(self) -> None:
        self._opening_at = _ns()

    def opened(self, error: Exception | None = None) -> None:
        if not self.on:
            return
        span = self.child("chorus.session.admit", self._opening_at, admitted=error is None)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end()

    def first_frame(self) -> None:
        if not self.on or self._first:
            return
        self._first = True
        now = _ns()
        if self._silent_since is not None:
            self.span.set_attribute("chorus.silence_ms", round(now / 1e6 - 1000 * self._silent_since, 1))
        self.child(
            "chorus.first_frame", self._opening_at, now, **{"chorus.wait_ms": _ms(self._opening_at, now)}
        )

    def event(self, item: Any, voiced_at: float = -1e9) -> None:
        """An engine event of the session; `voiced_at`: the monotonic time of the caller's last loud frame."""
        if not self.on or isinstance(item, AudioFrame):
            return
        now = _ns()
        if isinstance(item, TurnStarted):
            self._turns += 1
            quiet = time.monotonic() - voiced_at
            attrs: dict[str, Any] = {"chorus.turn": self._turns}
            if 0 <= quiet <= MOUTH_TO_EAR_MAX_S:
                attrs["chorus.mouth_to_ear_ms"] = round(1000 * quiet, 1)
            self._end_turn(now)
            self._turn = (now, self.child("chorus.turn", now, **attrs))
        elif isinstance(item, TurnEnded):
            self._end_turn(now)
        elif isinstance(item, ToolCallStarted):
            self._end_turn(now)
            self._paused_at = now
        elif isinstance(item, FunctionCall):
            self._tools.append(_Tool(self._paused_at or now, now, item.call_id, item.name))
        elif isinstance(item, ToolCallRejected):
            paused = self._paused_at or now
            span = self.child("chorus.tool_call", paused, **{"chorus.outcome": "rejected"})
            span.set_status(Status(StatusCode.ERROR, "rejected"))
            span.end(end_time=now)
        elif isinstance(item, ToolResultConsumed):
            self._tools_done(now, item.call_ms, item.resume_ms)
        elif isinstance(item, SessionFailed):
            self.span.add_event("chorus.session_failed", {"chorus.tick": item.tick})

    def result(self, call_id: str, is_error: bool) -> None:
        """The tool's result handed to the engine."""
        for t in self._tools:
            if t.call_id == call_id and t.answered is None:
                t.answered, t.is_error = _ns(), is_error

    def _end_turn(self, now: int) -> None:
        if self._turn is not None:
            start, span = self._turn
            self._turn = None
            span.set_attribute("chorus.turn_ms", _ms(start, now))
            span.end(end_time=now)

    def _tools_done(
        self, now: int, call_ms: float = 0.0, resume_ms: float = 0.0, ended: bool = False
    ) -> None:
        for t in self._tools:
            outcome = "unanswered" if t.answered is None else "error" if t.is_error else "ok"
            answered = t.answered if t.answered is not None else now
            attrs = {
                "chorus.tool": t.name,
                "chorus.call_id": t.call_id,
                "chorus.outcome": outcome,
                "chorus.model_ms": _ms(t.paused, t.called),
                "chorus.tool_ms": _ms(t.called, answered),
            }
            if not ended:
                attrs |= {
                    "chorus.prefill_ms": _ms(answered, now),
                    "chorus.engine.call_ms": round(call_ms, 1),
                    "chorus.engine.resume_ms": round(resume_ms, 1),
                }
            span = self.child("chorus.tool_call", t.paused, **attrs)
            ctx = trace.set_span_in_context(span)
            parts = [("chorus.tool.model", t.paused, t.called), ("chorus.tool.run", t.called, answered)]
            if not ended:
                parts.append(("chorus.tool.prefill", answered, now))
            for name, a, b in parts:
                tracing.tracer().start_span(name, context=ctx, start_time=a).end(end_time=b)
            if outcome != "ok":
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end(end_time=now)
        self._tools = []
        self._paused_at = None

    # -- the room's side (agent/room.py, agent/audio_out/playout.py) ----------------------------------

    def clip(self, start_ns: int, end_ns: int, kind: str) -> None:
        self.child("chorus.hold_clip", start_ns, end_ns, **{"chorus.clip": kind})

    def end(self, reason: str, **attributes: Any) -> None:
        """The call is over: what is open is closed, the call's span ended with `reason` (Chorus's own words:
        "the caller left", "the phone call was transferred", ...)."""
        if not self.on:
            return
        now = _ns()
        self._end_turn(now)
        if self._tools:
            self._tools_done(now, ended=True)
        self.span.set_attributes({"chorus.end_reason": reason, **attributes})
        self.span.end(end_time=now)
        self.on = False


def _ms(a: int, b: int) -> float:
    return round((b - a) / 1e6, 1)


NO_TRACE = CallTrace(None)  # off: every method returns at once


def current() -> CallTrace:
    """The trace of the call whose context this is (`CallTrace.activate`), or one that records nothing."""
    return _current.get() or NO_TRACE
