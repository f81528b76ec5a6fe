"""A tool call's life on the engine's side, for every session.

The live step's function channel emits start-of-call: `start` pauses the session (TOOL_CALL). The slack's
call steps then produce its tokens one by one (`token`) until end-of-call, when the call is parsed and each
function call goes out to the agent (WAITING), or the call is rejected in words the model reads back.
`receive` takes the submitted results in (from the session's requests, on the tick thread) and `poll` times
out the ones later than `tool_timeout_s` between steps; the complete results are tokenised off the tick
thread (`encode_pool`), and their prefill is due within `result_ticks` (PREFILL). After the replay the
scheduler brings the session back (`resume`), and the call is logged for the snapshot. The scheduler owns the
phases around it; this owns what happens to the call: the session's `call` part (engine/tick/session.py) is
written here only, and its phases change through `Session.enter`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from engine.api import (
    FunctionCall,
    Output,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
)
from engine.text.tokens import Tokens, ToolCallError, parse_tool_call
from engine.tick.plan import CallRecord, Limits, SlackOutcome
from engine.tick.session import Phase, Session
from redaction import opaque_id

log = logging.getLogger("chorus.engine.toolcalls")

CALL_LOG = 50  # finished tool calls kept for the snapshot


class ToolCalls:
    def __init__(
        self, tokens: Tokens, limits: Limits, clock: Callable[[], float], encode_pool: Executor | None = None
    ) -> None:
        """`encode_pool` is where tool results are tokenised, off the tick thread (None: inline)."""
        self.tok, self.limits, self.clock, self.encode_pool = tokens, limits, clock, encode_pool
        self.log: deque[CallRecord] = deque(maxlen=CALL_LOG)  # the latest finished calls, newest last
        self._started: dict[str, int] = {}  # session id -> the tick its call started

    def forget(self, s: Session) -> None:
        """`s` closed: a call it was making is dropped."""
        self._started.pop(s.id, None)

    def start(self, s: Session, tick: int, out: list[Output]) -> None:
        """The live step of `tick` emitted start-of-call for `s`: it pauses (the scheduler ended a turn it
        was speaking)."""
        s.enter(Phase.TOOL_CALL, tick)
        s.progress.tick = tick  # its first call token comes from this tick's live step
        c = s.call
        c.tokens = []
        c.names, c.failed = (), False
        c.t_start = self.clock()
        c.count += 1
        self._started[s.id] = tick
        out.append(ToolCallStarted(tick))

    def token(self, s: Session, tick: int, token: int, done: SlackOutcome) -> bool:
        """A token of `s`'s call from a call step of `tick`; at end-of-call the call is read and sent out.
        True when the call was refused (too long, or unreadable)."""
        c = s.call
        if token != self.tok.call_end:
            c.tokens.append(token)
            if len(c.tokens) >= self.limits.max_call_tokens:
                self._reject(s, tick, f"the tool call exceeded {self.limits.max_call_tokens} tokens")
                return True
            return False
        now = self.clock()
        c.ms = (now - c.t_start) * 1e3
        done.calls.append((c.ms, tick - self._started.pop(s.id, tick)))
        try:
            calls = parse_tool_call(self.tok.decode(c.tokens))
        except ToolCallError as e:
            self._reject(s, tick, str(e))
            return True
        except Exception as e:  # noqa: BLE001 (whatever the model wrote, it is this session's bad call, never the tick's)
            self._reject(s, tick, f"the tool call cannot be read ({type(e).__name__})")
            return True
        out: list[Output] = []
        pending: dict = {}  # filled, then set whole: the handle reads it from the agent's thread
        c.results = {}
        c.names = tuple(call.name for call in calls)
        for call in calls:
            call_id = "call_" + opaque_id()
            pending[call_id] = call
            if call.name not in s.tools:
                c.results[call_id] = _error(call.name, _no_such_tool(call.name))
                c.errors += 1
                out.append(ToolCallRejected(tick, f"unknown tool {call.name!r}"))
            else:
                out.append(FunctionCall(tick, call_id, call.name, json.dumps(call.arguments)))
        c.pending = pending
        s.enter(Phase.WAITING, tick)
        c.wait_deadline = now + self.limits.tool_timeout_s
        c.t_last_result = 0.0
        s.deliver(out)
        return False

    def receive(self, s: Session, result: dict, now: float) -> None:
        """A result the agent submitted (taken from the session's requests on the tick thread): kept when it
        answers a function call still waiting for one, else dropped."""
        c = s.call
        call = c.pending.get(result["call_id"])
        if call is not None and result["call_id"] not in c.results:
            c.results[result["call_id"]] = {**result, "name": call.name}
            c.t_last_result = now

    def poll(self, sessions: list[Session], tick: int, now: float) -> None:
        """Between steps: time out late results, start prefills of complete ones."""
        for s in sessions:
            if s.phase is not Phase.WAITING or s.closed:
                continue
            c = s.call
            if c.response is not None:  # the results are in; their tokens are on their way
                if c.response.done():
                    self._prefill_response(s, tick, self._response_ids(s))
                continue
            if len(c.results) < len(c.pending) and now >= c.wait_deadline:
                for call_id, call in c.pending.items():
                    if call_id not in c.results:
                        c.results[call_id] = _error(
                            call.name, f"the tool did not answer within {self.limits.tool_timeout_s:g} s"
                        )
                        c.errors += 1
                c.t_last_result = now
            if len(c.results) == len(c.pending):
                ordered = [c.results[i] for i in c.pending]
                self._begin_result_prefill(s, tick, [_public(r) for r in ordered])

    def resume(self, s: Session, tick: int) -> None:
        """`s` is live again at `tick`; a call it was back from is logged and reported."""
        s.enter(Phase.LIVE, tick)
        c = s.call
        if c.t_start > 0:
            resume_ms = (self.clock() - c.t_last_result) * 1e3
            tool_ms = max(0.0, (c.t_last_result - c.t_start) * 1e3 - c.ms)
            self.log.append(
                CallRecord(s.id, s.label, c.names, not c.failed, time.time(), c.ms, tool_ms, resume_ms)
            )
            s.deliver([ToolResultConsumed(tick, c.ms, resume_ms)])
            c.t_start = 0.0

    def _reject(self, s: Session, tick: int, reason: str) -> None:
        c = s.call
        c.errors += 1
        c.ms = (self.clock() - c.t_start) * 1e3
        self._started.pop(s.id, None)
        s.deliver([ToolCallRejected(tick, reason)])
        c.t_last_result = self.clock()
        self._begin_result_prefill(s, tick, [{"error": f"Your tool call could not be run: {reason}."}])

    def _begin_result_prefill(self, s: Session, tick: int, results: list[dict]) -> None:
        """The results are complete: their tokens are encoded by `encode_pool` (off the tick thread: a long
        result would otherwise stall every session), and the prefill starts on the first poll after."""
        c = s.call
        c.pending, c.results = {}, {}
        c.failed = any("error" in r for r in results)
        if not c.t_last_result:
            c.t_last_result = self.clock()
        if self.encode_pool is None:
            try:
                ids = self._encode(results)
            except Exception as e:  # noqa: BLE001 (a result that cannot be encoded is this session's unread result, never the tick's)
                ids = self._unread(s, e)
            self._prefill_response(s, tick, ids)
            return
        if s.phase is not Phase.WAITING:  # a refused call waits for its answer's tokens too
            s.enter(Phase.WAITING, tick)
        c.response = self.encode_pool.submit(self._encode, results)

    def _encode(self, results: list[dict]) -> list[int]:
        """The tokens of `results`, their text made encodable first (on `encode_pool`)."""
        return self.tok.response_ids([{k: _encodable(v) for k, v in r.items()} for r in results])

    def _response_ids(self, s: Session) -> list[int]:
        """The encoded results of a finished `s.call.response`."""
        response, s.call.response = s.call.response, None
        try:
            return response.result()
        except Exception as e:  # noqa: BLE001 (a result that cannot be encoded is this session's unread result, never the tick's)
            return self._unread(s, e)

    def _unread(self, s: Session, e: Exception) -> list[int]:
        """The results could not be encoded: the model still hears that its call came back, and the call
        counts as failed."""
        log.error("session %s: the tool results could not be tokenised (%s)", s.id, type(e).__name__)
        s.call.errors += 1
        s.call.failed = True
        return self.tok.response_ids([{"error": "the tool results could not be read"}])

    def _prefill_response(self, s: Session, tick: int, ids: list[int]) -> None:
        # within `result_ticks`; a result too long for that at one chunk a tick takes one chunk a tick, so
        # an oversized result never forces more than a chunk a tick onto everyone else's cadence
        by = tick + max(self.limits.result_ticks, math.ceil(len(ids) / self.limits.result_chunk))
        s.enter(Phase.PREFILL, tick, ids=ids, by=by)


def _encodable(value: object) -> object:
    """Text as UTF-8 can carry it: a lone surrogate (half of a pair, which no encoder takes) becomes U+FFFD,
    and two halves in order become the character they make. Anything but text is left as it is."""
    if not isinstance(value, str):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return value


def _no_such_tool(name: str) -> str:
    """What the model hears for a call of a tool it was not given: a name with a character that does not
    print (a control or an invisible one) is answered by naming the character, which a quote cannot show."""
    shown = "".join(ch for ch in name if ch.isprintable())
    shown = shown if len(shown) <= 40 else shown[:39] + "…"
    hidden = next((ch for ch in name if not ch.isprintable()), None)
    if hidden is None:
        return f"there is no tool named {shown!r}"
    return (
        f"the tool name {shown!r} contains an invisible character, U+{ord(hidden):04X}; "
        "send the name without it"
    )


def _error(name: str, message: str) -> dict:
    return {"name": name, "error": message, "is_error": True}


def _public(r: dict) -> dict:
    """A result as the model reads it."""
    if r.get("is_error"):
        return {"name": r["name"], "error": r.get("error") or r.get("output")}
    return {"name": r["name"], "output": r["output"]}
