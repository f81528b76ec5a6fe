"""A tool call's life on the engine's side, for every session.

The live step's function channel emits start-of-call: `start` pauses the session (TOOL_CALL). The slack's
call steps then produce its tokens one by one (`token`) until end-of-call, when the call is parsed and each
function call goes out to the agent (WAITING), or the call is rejected in words the model reads back.
`poll` gathers the submitted results between steps and times out the ones later than `tool_timeout_s`; the
complete results are tokenised off the tick thread (`encode_pool`), and their prefill is due within
`result_ticks` (PREFILL). After the replay the scheduler brings the session back (`resume`), and the call
is logged for the snapshot. The scheduler owns the phases around it; this owns what happens to the call.
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
    TurnEnded,
)
from engine.plan import CallRecord, Limits, SlackOutcome
from engine.slots import Phase, Session
from engine.tokens import Tokens, ToolCallError, parse_tool_call
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
        """The live step of `tick` emitted start-of-call for `s`: it pauses, and a turn it speaks ends."""
        s.phase = Phase.TOOL_CALL
        s.progress_tick = tick  # its first call token comes from this tick's live step
        s.call_tokens = []
        s.call_names, s.call_failed = (), False
        s.t_call_start = self.clock()
        s.tool_calls += 1
        self._started[s.id] = tick
        if s.speaking:  # a call interrupts the model's own turn
            s.speaking = False
            out.append(TurnEnded(tick))
        out.append(ToolCallStarted(tick))

    def token(self, s: Session, tick: int, token: int, done: SlackOutcome) -> None:
        """A token of `s`'s call from a call step of `tick`; at end-of-call the call is read and sent out."""
        if token != self.tok.call_end:
            s.call_tokens.append(token)
            if len(s.call_tokens) >= self.limits.max_call_tokens:
                self._reject(s, tick, f"the tool call exceeded {self.limits.max_call_tokens} tokens")
            return
        now = self.clock()
        s.call_ms = (now - s.t_call_start) * 1e3
        done.calls.append((s.call_ms, tick - self._started.pop(s.id, tick)))
        try:
            calls = parse_tool_call(self.tok.decode(s.call_tokens))
        except ToolCallError as e:
            self._reject(s, tick, str(e))
            return
        except Exception as e:  # whatever the model wrote, it is this session's bad call, never the tick's
            self._reject(s, tick, f"the tool call cannot be read ({type(e).__name__})")
            return
        out: list[Output] = []
        s.pending, s.results = {}, {}
        s.call_names = tuple(call.name for call in calls)
        for call in calls:
            call_id = "call_" + opaque_id()
            s.pending[call_id] = call
            if call.name not in s.tools:
                s.results[call_id] = _error(call.name, _no_such_tool(call.name))
                s.tool_errors += 1
                out.append(ToolCallRejected(tick, f"unknown tool {call.name!r}"))
            else:
                out.append(FunctionCall(tick, call_id, call.name, json.dumps(call.arguments)))
        s.phase = Phase.WAITING
        s.wait_deadline = now + self.limits.tool_timeout_s
        s.t_last_result = 0.0
        s.deliver(out)

    def poll(self, sessions: list[Session], tick: int, now: float) -> None:
        """Between steps: gather submitted results, time out late ones, start prefills."""
        for s in sessions:
            if s.phase is not Phase.WAITING or s.closed:
                continue
            if s.response is not None:  # the results are in; their tokens are on their way
                if s.response.done():
                    self._prefill_response(s, tick, self._response_ids(s))
                continue
            while not s.incoming.empty():
                r = s.incoming.get_nowait()
                if r["call_id"] in s.pending and r["call_id"] not in s.results:
                    s.results[r["call_id"]] = r
                    s.t_last_result = now
            if len(s.results) < len(s.pending) and now >= s.wait_deadline:
                for call_id, call in s.pending.items():
                    if call_id not in s.results:
                        s.results[call_id] = _error(
                            call.name, f"the tool did not answer within {self.limits.tool_timeout_s:g} s"
                        )
                        s.tool_errors += 1
                s.t_last_result = now
            if len(s.results) == len(s.pending):
                ordered = [s.results[c] for c in s.pending]
                self._begin_result_prefill(s, tick, [_public(r) for r in ordered])

    def resume(self, s: Session, tick: int) -> None:
        """`s` is live again at `tick`; a call it was back from is logged and reported."""
        s.phase = Phase.LIVE
        if s.t_call_start > 0:
            resume_ms = (self.clock() - s.t_last_result) * 1e3
            tool_ms = max(0.0, (s.t_last_result - s.t_call_start) * 1e3 - s.call_ms)
            self.log.append(
                CallRecord(
                    s.id, s.label, s.call_names, not s.call_failed, time.time(), s.call_ms, tool_ms, resume_ms
                )
            )
            s.deliver([ToolResultConsumed(tick, s.call_ms, resume_ms)])
            s.t_call_start = 0.0

    def _reject(self, s: Session, tick: int, reason: str) -> None:
        s.tool_errors += 1
        s.call_ms = (self.clock() - s.t_call_start) * 1e3
        self._started.pop(s.id, None)
        s.deliver([ToolCallRejected(tick, reason)])
        s.t_last_result = self.clock()
        self._begin_result_prefill(s, tick, [{"error": f"Your tool call could not be run: {reason}."}])
        s.force_func.clear()

    def _begin_result_prefill(self, s: Session, tick: int, results: list[dict]) -> None:
        """The results are complete: their tokens are encoded by `encode_pool` (off the tick thread: a long
        result would otherwise stall every session), and the prefill starts on the first poll after."""
        s.pending, s.results = {}, {}
        s.call_failed = any("error" in r for r in results)
        if not s.t_last_result:
            s.t_last_result = self.clock()
        if self.encode_pool is None:
            try:
                ids = self._encode(results)
            except Exception as e:
                ids = self._unread(s, e)
            self._prefill_response(s, tick, ids)
            return
        s.phase = Phase.WAITING
        s.response = self.encode_pool.submit(self._encode, results)

    def _encode(self, results: list[dict]) -> list[int]:
        """The tokens of `results`, their text made encodable first (on `encode_pool`)."""
        return self.tok.response_ids([{k: _encodable(v) for k, v in r.items()} for r in results])

    def _response_ids(self, s: Session) -> list[int]:
        """The encoded results of a finished `s.response`."""
        response, s.response = s.response, None
        try:
            return response.result()
        except Exception as e:
            return self._unread(s, e)

    def _unread(self, s: Session, e: Exception) -> list[int]:
        """The results could not be encoded: the model still hears that its call came back, and the call
        counts as failed."""
        log.error("session %s: the tool results could not be tokenised (%s)", s.id, type(e).__name__)
        s.tool_errors += 1
        s.call_failed = True
        return self.tok.response_ids([{"error": "the tool results could not be read"}])

    def _prefill_response(self, s: Session, tick: int, ids: list[int]) -> None:
        s.phase = Phase.PREFILL
        # within `result_ticks`; a result too long for that at one chunk a tick takes one chunk a tick, so
        # an oversized result never forces more than a chunk a tick onto everyone else's cadence
        s.prefill_by = tick + max(self.limits.result_ticks, math.ceil(len(ids) / self.limits.result_chunk))
        s.prefill_ids = ids
        s.prefill_pos = 0


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
