"""The tick's plan and its bookkeeping: who is live, what paused work runs this tick, and what a result means.

`plan_live` and `apply_live` bracket the one batched live step; `next_tool_work` (what fits in the slack) or
`owed_work` (what is due this tick whatever the slack) and `apply_tool` bracket each piece of paused work
(tool-call tokens, result and prompt prefill, replay). CPU-only and model-free: it works on numpy arrays and
hand-made results, so it is tested without a model.

Progress is guaranteed, not left to the slack. The engine gives paused work a reserved share of every tick
even when the live step left less slack, and `owed_work` forces what must not wait whatever the time left: a
call-token step for every session calling a tool, and the prompt and result positions due this tick. Bounds
are counted in ticks. A new session is live by `admission_ticks` after it opened: its prompt is prefilled in
chunks sized to finish in the first two thirds of that bound, and the caller audio held meanwhile is replayed
in the rest. Tool results are prefilled within `result_ticks` of arriving (a longer one at a chunk a tick),
and the session is live again `replay_ticks` after that. Held audio that cannot be replayed by then is
skipped, silence first, and counted (`FrameInbox.skip`); a live session whose backlog grows past
`live_lag_frames` (a slow machine, a burst from the network) sheds its silent frames.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from engine.api import (
    AudioFrame,
    FunctionCall,
    Output,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
    TurnEnded,
    TurnStarted,
)
from engine.slots import Phase, Session
from engine.tokens import Tokens, ToolCallError, parse_tool_call

log = logging.getLogger("chorus.engine.scheduler")

WorkKind = Literal["call", "result", "replay", "prompt"]
PRIORITY: tuple[WorkKind, ...] = ("call", "result", "replay", "prompt")
CALL_LOG = 50  # finished tool calls kept for the snapshot


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One finished tool call, made once per call (when the session is live again), read by snapshots."""

    session: str
    label: str
    names: tuple[str, ...]  # () when the call could not be read
    ok: bool  # every result came back without an error
    at: float  # wall-clock time (Unix seconds) the session was live again
    call_ms: float  # start of call -> function calls emitted (the model writing the call)
    tool_ms: float  # function calls emitted -> the last result submitted (the tool's own time)
    resume_ms: float  # last result -> live again (result prefill and replay)


@dataclass(frozen=True)
class Limits:
    max_call_tokens: int = 512
    tool_timeout_s: float = 15.0
    prefill_chunk: int = 64  # prompt positions per prefill forward in the slack
    result_chunk: int = 64  # tool-result positions per prefill forward
    max_chunk: int = 256  # the most positions one prefill forward may take (the thinker's attention window)
    admission_ticks: int = 25  # a new session is live within this many ticks (2 s)
    replay_ticks: int = 25  # a session back from a tool is live within this many ticks of its results
    result_ticks: int = 12  # tool results are prefilled within this many ticks of arriving (1 s)
    owed_rows: int = 8  # rows of one forced piece of work (the least recently served first)
    live_lag_frames: int = 12  # a live session's backlog beyond this sheds its silent frames


@dataclass
class LivePlan:
    """Inputs of the live step, one row per slot; rows that are not live are computed but change nothing."""

    tick: int
    live: np.ndarray  # [S] bool
    audio: np.ndarray  # [S, 1280] float32 (silence where no frame)
    force_text: np.ndarray  # [S] int64, -1 = the model's own token
    force_func: np.ndarray  # [S] int64
    reset: np.ndarray  # [S] bool: rows to return to a fresh state before the step
    quiet: np.ndarray | None = None  # [S] bool: replaying rows, agent channels forced silent, output withheld
    restore: list[tuple[int, int]] = field(default_factory=list)  # (slot, prompt key): load a cached prompt


@dataclass
class LiveResult:
    text: np.ndarray  # [S] int64
    func: np.ndarray  # [S] int64
    audio: np.ndarray  # [S, 1764] float32


@dataclass
class ToolWork:
    """One piece of slack work over a batch of paused slots."""

    kind: WorkKind
    sessions: list[Session]
    slots: np.ndarray  # [b] int64
    tokens: np.ndarray  # call: forced func token [b, 1] (-1 none); result/prompt: ids [b, T]; replay: unused
    audio: np.ndarray | None = None  # replay: [S, 1280] with the replayed frames in the replaying rows
    active: np.ndarray | None = None  # replay: [S] bool


@dataclass
class ToolResult:
    func: np.ndarray | None = None  # call: [b] int64 tokens produced


@dataclass
class CostModel:
    """Predicted milliseconds per piece of slack work, learned from measurements per kind and shape: an EMA of
    the cost plus two EMAs of its deviation, so a noisy machine plans with a margin without one outlier
    locking the estimate high."""

    default_ms: float = 5.0
    alpha: float = 0.2
    table: dict[tuple[str, int, int], float] = field(default_factory=dict)  # the prediction per shape
    _mean: dict[tuple[str, int, int], float] = field(default_factory=dict)
    _dev: dict[tuple[str, int, int], float] = field(default_factory=dict)

    @staticmethod
    def _key(kind: str, b: int, t: int) -> tuple[str, int, int]:
        bucket = 1 << max(0, (b - 1).bit_length())  # 1, 2, 4, 8, ...
        return kind, bucket, t

    def predict(self, kind: str, b: int, t: int = 1) -> float:
        """Measured cost of the same kind and shape, else the nearest measured shape scaled by work units."""
        key = self._key(kind, b, t)
        if key in self.table:
            return self.table[key]
        units = key[1] * t
        same = [(bb * tt, v) for (k, bb, tt), v in self.table.items() if k == kind]
        if not same:
            return self.default_ms
        ref_units, ref_ms = min(same, key=lambda uv: abs(uv[0] - units))
        return ref_ms * units / ref_units

    def observe(self, kind: str, b: int, t: int, ms: float) -> None:
        key = self._key(kind, b, t)
        if key not in self._mean:
            self._mean[key], self._dev[key] = ms, 0.0
        else:
            mean = self._mean[key]
            self._dev[key] += self.alpha * (abs(ms - mean) - self._dev[key])
            self._mean[key] = mean + self.alpha * (ms - mean)
        self.table[key] = self._mean[key] + 2 * self._dev[key]


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        tokens: Tokens,
        frame_in: int,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.S = num_slots
        self.clock = clock
        self.tok = tokens
        self.frame_in = frame_in
        self.limits = limits or Limits()
        self.costs = CostModel()
        self.sessions: list[Session] = []
        self.completed_calls: list[tuple[float, int]] = []  # (ms, ticks) per finished call, for the engine
        self.call_log: deque[CallRecord] = deque(maxlen=CALL_LOG)  # the latest tool calls, newest last
        # prompts whose prefilled state the runner holds (by key), and the ones it should save next
        self.cached_prompts: set[int] = set()
        self.saves: list[tuple[int, int]] = []
        self.call_started_tick: dict[str, int] = {}
        self.encode_pool: Executor | None = None  # where tool results are tokenised (None: inline)
        self.tick = 0
        self.underruns = 0

    # -- the live step --------------------------------------------------------------------------------

    def plan_live(self, tick: int, sessions: list[Session], reset: np.ndarray) -> LivePlan:
        """Every LIVE and REPLAY session steps in the live batch (REPLAY quietly: its held audio goes in, the
        agent channels are forced silent and nothing comes out); a PROMPT session whose prompt is cached
        gets the cached state instead of a prefill."""
        self.tick = tick
        self.sessions = sessions
        S = self.S
        live = np.zeros(S, dtype=bool)
        quiet = np.zeros(S, dtype=bool)
        audio = np.zeros((S, self.frame_in), dtype=np.float32)
        force_text = np.full(S, -1, dtype=np.int64)
        force_func = np.full(S, -1, dtype=np.int64)
        restore: list[tuple[int, int]] = []
        lim = self.limits
        for s in sessions:
            if s.closed:
                continue
            if s.live_by is None:  # first seen: opened since the last tick
                s.live_by = tick + lim.admission_ticks
            if s.phase is Phase.PROMPT and s.prefill_pos == 0 and s.prompt_key in self.cached_prompts:
                restore.append((s.slot, s.prompt_key))
                s.prefill_ids = []
                s.phase = Phase.REPLAY
            if s.phase is Phase.PROMPT:
                # positions due this tick: the prompt is done two thirds into the admission bound, and a
                # short one at once
                due = s.live_by - lim.admission_ticks // 3
                left = len(s.prefill_ids) - s.prefill_pos
                s.owed = max(math.ceil(left / max(1, due - tick)), min(left, lim.prefill_chunk))
            elif s.phase is Phase.PREFILL:  # result positions due this tick, at least a chunk
                left = len(s.prefill_ids) - s.prefill_pos
                s.owed = max(math.ceil(left / max(1, s.prefill_by - tick)), min(left, lim.result_chunk))
            elif s.phase is Phase.REPLAY:
                # silence beyond what one catch-up step a tick could clear by `live_by` is skipped as soon as
                # it is found; at `live_by`, whatever is left beyond this tick's frame and one is skipped
                ahead = s.live_by - tick
                s.inbox.skip(len(s.inbox) - 2 - max(0, ahead), silent_only=ahead > 0)
            elif s.phase is Phase.LIVE and len(s.inbox) > lim.live_lag_frames + 1:
                s.inbox.skip(len(s.inbox) - 1 - lim.live_lag_frames, silent_only=True)
            if s.phase is Phase.REPLAY and len(s.inbox) <= 2:
                # caught up: this tick takes one frame and one stays as jitter buffer (a frame arrives
                # every tick, so "one more than after" is what a caught-up session has at planning time)
                self._resume(s)
            if s.phase is Phase.LIVE:
                live[s.slot] = True
                if s.force_text:
                    force_text[s.slot] = s.force_text.popleft()
                if s.force_func:
                    force_func[s.slot] = s.force_func.popleft()
            elif s.phase is Phase.REPLAY:
                live[s.slot] = quiet[s.slot] = True
            else:
                continue
            frame = s.inbox.pop()
            if frame is None:
                s.underruns += 1
                self.underruns += 1
            else:
                audio[s.slot] = frame
                s.frames_consumed += 1
                s.frames_replayed += quiet[s.slot]
        return LivePlan(tick, live, audio, force_text, force_func, reset, quiet, restore)

    def apply_live(self, plan: LivePlan, result: LiveResult) -> None:
        for s in self.sessions:
            if not plan.live[s.slot] or plan.quiet[s.slot]:
                continue
            out: list[Output] = []
            text, func = int(result.text[s.slot]), int(result.func[s.slot])
            piece = self.tok.piece(text)
            if text == self.tok.bos and not s.speaking:
                s.speaking = True
                s.said.clear()
                out.append(TurnStarted(plan.tick))
            if piece and s.speaking:
                s.said.append(piece)  # the vocabulary's own string: nothing is copied
            out.append(AudioFrame(plan.tick, result.audio[s.slot], piece))
            if text == self.tok.eos and s.speaking:
                s.speaking = False
                out.append(TurnEnded(plan.tick))
            if func == self.tok.call_start:
                self._start_call(s, out)
            s.deliver(out)

    # -- tool work in the slack -----------------------------------------------------------------------

    def _start_call(self, s: Session, out: list[Output]) -> None:
        s.phase = Phase.TOOL_CALL
        s.progress_tick = self.tick  # its first call token comes from this tick's live step
        s.call_tokens = []
        s.call_names, s.call_failed = (), False
        s.t_call_start = self.clock()
        s.tool_calls += 1
        self.call_started_tick[s.id] = self.tick
        if s.speaking:  # a call interrupts the model's own turn
            s.speaking = False
            out.append(TurnEnded(self.tick))
        out.append(ToolCallStarted(self.tick))

    def poll(self, now: float) -> None:
        """Between ticks: gather submitted results, time out late ones, start prefills."""
        for s in self.sessions:
            if s.phase is not Phase.WAITING or s.closed:
                continue
            if s.response is not None:  # the results are in; their tokens are on their way
                if s.response.done():
                    self._prefill_response(s, self._response_ids(s))
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
                self._begin_result_prefill(s, [_public(r) for r in ordered])

    def _begin_result_prefill(self, s: Session, results: list[dict]) -> None:
        """The results are complete: their tokens are encoded by `encode_pool` (off the tick thread: a long
        result would otherwise stall every session), and the prefill starts on the first poll after."""
        s.pending, s.results = {}, {}
        s.call_failed = any("error" in r for r in results)
        if not s.t_last_result:
            s.t_last_result = self.clock()
        if self.encode_pool is None:
            self._prefill_response(s, self.tok.response_ids(results))
            return
        s.phase = Phase.WAITING
        s.response = self.encode_pool.submit(self.tok.response_ids, results)

    def _response_ids(self, s: Session) -> list[int]:
        """The encoded results of a finished `s.response`."""
        response, s.response = s.response, None
        try:
            return response.result()
        except Exception as e:  # the model still hears that its call came back
            log.error("session %s: the tool results could not be tokenised (%s)", s.id, type(e).__name__)
            return self.tok.response_ids([{"error": "the tool results could not be read"}])

    def _prefill_response(self, s: Session, ids: list[int]) -> None:
        s.phase = Phase.PREFILL
        # within `result_ticks`; a result too long for that at one chunk a tick takes one chunk a tick, so
        # an oversized result never forces more than a chunk a tick onto everyone else's cadence
        s.prefill_by = self.tick + max(
            self.limits.result_ticks, math.ceil(len(ids) / self.limits.result_chunk)
        )
        s.prefill_ids = ids
        s.prefill_pos = 0

    def _fit(self, kind: str, n: int, t_max: int, budget_ms: float) -> tuple[int, int] | None:
        """The largest (rows, positions) of this kind predicted to fit in the budget: halve the positions
        first (keeps every row moving), then the rows."""
        b = n
        while b >= 1:
            t = t_max
            while t >= 1:
                if self.costs.predict(kind, b, t) <= budget_ms:
                    return b, t
                t //= 2
            b //= 2
        return None

    def next_tool_work(
        self, budget_ms: float, skip: frozenset[str] = frozenset(), served: frozenset[str] = frozenset()
    ) -> ToolWork | None:
        """The most urgent piece of slack work predicted to fit in budget_ms, or None.

        Priority: tool-call tokens (a caller is waiting), result prefill, replay, prompt prefill; but every
        kind not yet `served` this tick comes before a second piece of any kind, so a stream of call tokens
        never starves the catch-up. Kinds in `skip` are not planned (the cadence-locked baseline runs each
        kind at most once per tick).
        """
        by_phase: dict[Phase, list[Session]] = {}
        for s in self.sessions:
            if not s.closed:
                by_phase.setdefault(s.phase, []).append(s)
        kinds = [k for k in PRIORITY if k not in skip]
        for kind in [k for k in kinds if k not in served] + [k for k in kinds if k in served]:
            work = self._plan(kind, by_phase, budget_ms)
            if work is not None:
                return work
        return None

    def _plan(
        self, kind: WorkKind, by_phase: dict[Phase, list[Session]], budget_ms: float
    ) -> ToolWork | None:
        lim = self.limits
        if kind == "call":
            calls = by_phase.get(Phase.TOOL_CALL, [])
            fit = self._fit("call", len(calls), 1, budget_ms) if calls else None
            if not fit:
                return None
            return _call_work(sorted(calls, key=lambda s: s.t_call_start)[: fit[0]])
        if kind == "replay":  # catch-up steps beyond the one the live batch gives; keep one frame for it
            ready = [s for s in by_phase.get(Phase.REPLAY, []) if len(s.inbox) >= 2]
            fit = self._fit(kind, len(ready), 1, budget_ms) if ready else None
            return self._replay_work(ready[: fit[0]]) if fit else None
        phase, chunk = (
            (Phase.PREFILL, lim.result_chunk) if kind == "result" else (Phase.PROMPT, lim.prefill_chunk)
        )
        group = by_phase.get(phase, [])
        group = self._prompt_leaders(group) if kind == "prompt" else sorted(group, key=_furthest_first)
        if not group:
            return None
        t_max = min(chunk, lim.max_chunk, *(len(s.prefill_ids) - s.prefill_pos for s in group))
        fit = self._fit(kind, len(group), t_max, budget_ms)
        return self._prefill_work(kind, group[: fit[0]], fit[1]) if fit else None

    def owed_work(self) -> ToolWork | None:
        """The next piece of work due this tick whatever the budget, or None: a call-token step for sessions
        calling a tool that have not moved this tick, then the result and prompt positions due this tick
        (`owed_rows` rows at a time, the least recently served first). Catch-up is not forced: the replay
        bound holds by skipping held audio."""
        tick, lim = self.tick, self.limits
        open_ = [s for s in self.sessions if not s.closed]

        def first(group: list[Session]) -> list[Session]:
            return sorted(group, key=lambda s: (s.progress_tick, s.opened_at))[: lim.owed_rows]

        if calls := [s for s in open_ if s.phase is Phase.TOOL_CALL and s.progress_tick != tick]:
            return _call_work(first(calls))
        if results := [s for s in open_ if s.phase is Phase.PREFILL and s.owed > 0]:
            group = first(results)
            return self._prefill_work("result", group, self._owed_chunk(group))
        leaders = self._prompt_leaders([s for s in open_ if s.phase is Phase.PROMPT])
        if group := [s for s in leaders if s.owed > 0][: lim.owed_rows]:
            return self._prefill_work("prompt", group, self._owed_chunk(group))
        return None

    def _prompt_leaders(self, prompting: list[Session]) -> list[Session]:
        """One session per distinct uncached prompt, the furthest along: it prefills, and the others with the
        same prompt start from its state once it is cached."""
        leaders: dict[int, Session] = {}
        for s in sorted(prompting, key=_furthest_first):
            if s.prompt_key not in self.cached_prompts:
                leaders.setdefault(s.prompt_key, s)
        return list(leaders.values())

    def _owed_chunk(self, group: list[Session]) -> int:
        return min(
            self.limits.max_chunk,
            max(s.owed for s in group),
            *(len(s.prefill_ids) - s.prefill_pos for s in group),
        )

    @staticmethod
    def _prefill_work(kind: WorkKind, group: list[Session], T: int) -> ToolWork:
        ids = np.array([s.prefill_ids[s.prefill_pos : s.prefill_pos + T] for s in group], dtype=np.int64)
        return ToolWork(kind, group, _slots(group), ids)

    def _replay_work(self, group: list[Session]) -> ToolWork:
        audio = np.zeros((self.S, self.frame_in), dtype=np.float32)
        active = np.zeros(self.S, dtype=bool)
        for s in group:
            audio[s.slot] = s.inbox.pop()
            active[s.slot] = True
            s.frames_consumed += 1
            s.frames_replayed += 1
        return ToolWork("replay", group, _slots(group), np.zeros((len(group), 0), np.int64), audio, active)

    def apply_tool(self, work: ToolWork, result: ToolResult, ms: float) -> None:
        T = work.tokens.shape[1] if work.kind in ("result", "prompt") else 1
        self.costs.observe(work.kind, len(work.sessions), T, ms)
        for s in work.sessions:
            s.progress_tick = self.tick
        if work.kind == "call":
            for s, token in zip(work.sessions, result.func, strict=True):
                if s.force_func:
                    s.force_func.popleft()
                self._call_token(s, int(token))
        elif work.kind in ("result", "prompt"):
            for s in work.sessions:
                s.prefill_pos += T
                s.owed -= T
                if s.prefill_pos >= len(s.prefill_ids):
                    if work.kind == "result":  # back from a tool: the held audio is replayed within the bound
                        s.live_by = self.tick + self.limits.replay_ticks
                    elif s.prompt_key not in self.cached_prompts:
                        self.cached_prompts.add(s.prompt_key)
                        self.saves.append((s.slot, s.prompt_key))
                    s.prefill_ids, s.prefill_pos = [], 0
                    s.phase = Phase.REPLAY

    def _call_token(self, s: Session, token: int) -> None:
        if token != self.tok.call_end:
            s.call_tokens.append(token)
            if len(s.call_tokens) >= self.limits.max_call_tokens:
                self._reject(s, f"the tool call exceeded {self.limits.max_call_tokens} tokens")
            return
        now = self.clock()
        s.call_ms = (now - s.t_call_start) * 1e3
        self.completed_calls.append((s.call_ms, self.tick - self.call_started_tick.pop(s.id, self.tick)))
        try:
            calls = parse_tool_call(self.tok.decode(s.call_tokens))
        except ToolCallError as e:
            self._reject(s, str(e))
            return
        except Exception as e:  # whatever the model wrote, it is this session's bad call, never the tick's
            self._reject(s, f"the tool call cannot be read ({type(e).__name__})")
            return
        out: list[Output] = []
        s.pending, s.results = {}, {}
        s.call_names = tuple(call.name for call in calls)
        for call in calls:
            call_id = "call_" + uuid.uuid4().hex[:12]
            s.pending[call_id] = call
            if call.name not in s.tools:
                s.results[call_id] = _error(call.name, f"there is no tool named {call.name!r}")
                s.tool_errors += 1
                out.append(ToolCallRejected(self.tick, f"unknown tool {call.name!r}"))
            else:
                out.append(FunctionCall(self.tick, call_id, call.name, json.dumps(call.arguments)))
        s.phase = Phase.WAITING
        s.wait_deadline = now + self.limits.tool_timeout_s
        s.t_last_result = 0.0
        s.deliver(out)

    def _reject(self, s: Session, reason: str) -> None:
        s.tool_errors += 1
        s.call_ms = (self.clock() - s.t_call_start) * 1e3
        self.call_started_tick.pop(s.id, None)
        s.deliver([ToolCallRejected(self.tick, reason)])
        s.t_last_result = self.clock()
        self._begin_result_prefill(s, [{"error": f"Your tool call could not be run: {reason}."}])
        s.force_func.clear()

    def _resume(self, s: Session) -> None:
        was_tool = s.t_call_start > 0
        s.phase = Phase.LIVE
        if was_tool:
            resume_ms = (self.clock() - s.t_last_result) * 1e3
            tool_ms = max(0.0, (s.t_last_result - s.t_call_start) * 1e3 - s.call_ms)
            self.call_log.append(CallRecord(s.id, s.label, s.call_names, not s.call_failed, time.time(),
                                            s.call_ms, tool_ms, resume_ms))  # fmt: skip
            s.deliver([ToolResultConsumed(self.tick, s.call_ms, resume_ms)])
            s.t_call_start = 0.0


def _furthest_first(s: Session) -> tuple[int, float]:
    return -s.prefill_pos, s.opened_at


def _call_work(group: list[Session]) -> ToolWork:
    """One call-token step for `group`, with each session's forced function token (-1: the model's own)."""
    forced = np.array([[s.force_func[0] if s.force_func else -1] for s in group], dtype=np.int64)
    return ToolWork("call", group, _slots(group), forced)


def _slots(sessions: list[Session]) -> np.ndarray:
    return np.array([s.slot for s in sessions], dtype=np.int64)


def _error(name: str, message: str) -> dict:
    return {"name": name, "error": message, "is_error": True}


def _public(r: dict) -> dict:
    """A result as the model reads it."""
    if r.get("is_error"):
        return {"name": r["name"], "error": r.get("error") or r.get("output")}
    return {"name": r["name"], "output": r["output"]}
