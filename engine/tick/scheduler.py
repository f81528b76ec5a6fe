"""The tick's plan and its bookkeeping: who is live, what paused work runs this tick, and what a result means.

One tick, as `Engine.run_tick` drives it, is sketched in docs/architecture.md ("One tick"); a tool call's own
life is `engine/tick/toolcalls.py`. The scheduler keeps no tick: `begin_tick` returns the `Tick` (number,
start, sessions) that every other call of the tick is given. The prompt cache it consults
(`engine/tick/prompt_cache.py`) is the runner's, filled by `Runner.save_prompt` for each of
`SlackOutcome.saves`.

CPU-only and model-free: it works on numpy arrays and hand-made results, so it is tested without a model.

Progress is guaranteed, not left to the slack. The engine gives paused work a reserved share of every tick
even when the live step left less slack, and `owed_work` forces what must not wait whatever the time left: a
call-token step for every session calling a tool, and the prompt and result positions due this tick. Bounds
are counted in ticks. A new session is live by `admission_ticks` after it opened: its prompt is prefilled in
chunks sized to finish in the first two thirds of that bound, and the caller audio held meanwhile is replayed
in the rest. Tool results are prefilled within `result_ticks` of arriving (a longer one at a chunk a tick),
and the session is live again `replay_ticks` after that. Held audio that cannot be replayed by then is
skipped, silence first, and counted (`FrameInbox.skip`); a live session whose backlog grows past
`live_lag_frames` (a slow machine, a burst from the network) sheds its silent frames, and one whose inbox had
a frame to spare at every tick for `spare_ticks` sheds one silent frame: the reserve follows the arrivals'
jitter instead of standing as a frame of latency (arrivals late again within `late_memory_ticks` keep it
twice as long each time, up to `max_spare_ticks`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial

import numpy as np

from engine.api import (
    AudioFrame,
    Output,
    TurnEnded,
    TurnStarted,
)
from engine.text.tokens import Tokens
from engine.tick.buckets import MAX_REPLAY_FRAMES
from engine.tick.plan import (
    PRIORITY,
    CallRecord,
    CostModel,
    Limits,
    LivePlan,
    LiveResult,
    SlackOutcome,
    Tick,
    ToolResult,
    ToolWork,
    WorkKind,
)
from engine.tick.prompt_cache import PromptCache
from engine.tick.session import Phase, Session
from engine.tick.slack_work import (
    call_work,
    furthest_first,
    largest_fit,
    owed_chunk,
    prefill_work,
    prompt_leaders,
    replay_work,
)
from engine.tick.toolcalls import ToolCalls

log = logging.getLogger("chorus.engine.scheduler")


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        tokens: Tokens,
        frame_in: int,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        encode_pool: Executor | None = None,
        prompts: PromptCache | None = None,
    ) -> None:
        """`encode_pool` is where tool results are tokenised, off the tick thread (None: inline); `prompts` is
        the runner's prompt cache (None: one of its own, for tests without a runner)."""
        self.S = num_slots
        self.clock = clock
        self.tok = tokens
        self.frame_in = frame_in
        self.limits = limits or Limits()
        self.costs = CostModel()
        self.calls = ToolCalls(tokens, self.limits, clock, encode_pool)
        self.prompts = prompts if prompts is not None else PromptCache(8)
        self.underruns = 0
        # per recent tick, the sessions found past a bound (a prompt not live by `live_by`, a result not
        # prefilled by `prefill_by`): the slack no longer holds them, and admission takes no one on
        self.slipped: deque[int] = deque(maxlen=100)

    # -- the tick -------------------------------------------------------------------------------------

    def begin_tick(
        self, number: int, sessions: list[Session], freed: list[Session] = (), t_start: float = math.nan
    ) -> Tick:
        """Tick `number` begins over the open `sessions`; `freed` closed since the last tick (a call they were
        making is forgotten). Every other method of this tick is given the Tick returned."""
        for s in freed:
            self.calls.forget(s)
        return Tick(number, sessions, t_start)

    def poll(self, tick: Tick, now: float) -> None:
        """Between steps: what the agents asked for (forced tokens, tool results) taken in, late results timed
        out, their prefills started."""
        receive = partial(self.calls.receive, now=now)
        for s in tick.sessions:
            if not s.closed:
                s.take_requests(receive)
        self.calls.poll(tick.sessions, tick.number, now)

    @property
    def call_log(self) -> deque[CallRecord]:
        """The latest finished tool calls, newest last (read by snapshots)."""
        return self.calls.log

    @property
    def cached_prompts(self) -> frozenset[int]:
        """The prompts whose prefilled state the runner holds (read across threads by admission)."""
        return self.prompts.keys

    # -- the live step --------------------------------------------------------------------------------

    def plan_live(self, tick: Tick, reset: np.ndarray) -> LivePlan:
        """Every LIVE and REPLAY session steps in the live batch (REPLAY quietly: its held audio goes in, the
        agent channels are forced silent and nothing comes out); a PROMPT session whose prompt is cached
        gets the cached state instead of a prefill. `reset`: the rows freed since the last tick."""
        k = tick.number
        S = self.S
        live = np.zeros(S, dtype=bool)
        quiet = np.zeros(S, dtype=bool)
        audio = np.zeros((S, self.frame_in), dtype=np.float32)
        force_text = np.full(S, -1, dtype=np.int64)
        force_func = np.full(S, -1, dtype=np.int64)
        restore: list[tuple[int, int]] = []
        arrived = np.full(S, np.nan)
        late = slips = 0
        lim = self.limits
        for s in tick.sessions:
            if s.closed:
                continue
            s.inbox.pull()  # a room in another process: its frames since the last tick
            p, f = s.progress, s.feed
            if p.live_by is None:  # first seen: opened since the last tick
                p.live_by = k + lim.admission_ticks
            if s.phase is Phase.PROMPT:
                # a state another session has made meanwhile replaces whatever this one made of it so far
                if s.prompt_key in self.prompts:
                    restore.append((s.slot, s.prompt_key))
                    s.enter(Phase.REPLAY, k)
                elif p.prefill_pos < s.prefix_len and s.prefix_key in self.prompts:  # the rest is prefilled
                    restore.append((s.slot, s.prefix_key))
                    p.prefill_pos = s.prefix_len
            if (s.phase is Phase.PROMPT and k > p.live_by) or (s.phase is Phase.PREFILL and k > p.prefill_by):
                slips += 1
            if s.phase is Phase.PROMPT:
                # positions due this tick: the prompt is done two thirds into the admission bound, and a
                # short one at once
                due = p.live_by - lim.admission_ticks // 3
                left = p.left
                p.owed = max(math.ceil(left / max(1, due - k)), min(left, lim.prefill_chunk))
            elif s.phase is Phase.PREFILL:  # result positions due this tick, at least a chunk
                left = p.left
                p.owed = max(math.ceil(left / max(1, p.prefill_by - k)), min(left, lim.result_chunk))
            elif s.phase is Phase.REPLAY:
                # silence beyond what one catch-up step a tick could clear by `live_by` is skipped as soon as
                # it is found; at `live_by`, whatever is left beyond this tick's frame is skipped
                ahead = p.live_by - k
                keep = 1 + lim.reserve_frames
                s.inbox.skip(len(s.inbox) - keep - max(0, ahead), silent_only=ahead > 0, keep=keep)
            elif s.phase is Phase.LIVE:
                backlog = len(s.inbox)
                if backlog > lim.live_lag_frames + 1:
                    s.inbox.skip(backlog - 1 - lim.live_lag_frames, silent_only=True)
                # a frame to spare at every tick for a while: the oldest goes if it is silent, else the slack
                # hears the reserve in a quiet step while the agent is not speaking (nothing of the caller is
                # lost; an 80 ms frame of the agent's silence is); a late arrival leaves the inbox empty at a
                # tick, and the next frame to arrive is the reserve again
                f.spare_ticks = f.spare_ticks + 1 if backlog >= 2 else 0
                if f.spare_ticks >= max(lim.spare_ticks, f.hold_ticks):
                    if s.inbox.skip(1, silent_only=True, keep=1):
                        f.spare_ticks = 0
                    elif not s.turn.speaking or lim.catch_up_in_turns:
                        f.catch_up, f.spare_ticks = True, 0
            if s.phase is Phase.REPLAY and len(s.inbox) <= 1 + lim.reserve_frames:
                # caught up: this tick takes the one frame there is. No frame stays as a reserve: steady
                # arrivals never need one, and a late arrival makes its own (the tick it misses hears
                # silence, counted as an underrun; the late frame then waits behind the next)
                self.calls.resume(s, k)
            if s.phase is Phase.LIVE:
                live[s.slot] = True
                forcing = s.forcing
                force_text[s.slot] = forcing.text.popleft() if forcing.text else forcing.hold_text
                force_func[s.slot] = forcing.func.popleft() if forcing.func else forcing.hold_func
            elif s.phase is Phase.REPLAY:
                live[s.slot] = quiet[s.slot] = True
            else:
                continue
            frame = s.inbox.pop()
            f.reserve = s.inbox.held
            if frame is None:
                f.underruns += 1
                self.underruns += 1
                f.missed_tick = k if f.fed_tick == k - 1 else -2
            else:
                # the last tick found no frame, and this one finds two: the last one's came after it (a
                # caller who stops sending underruns, and is not late)
                if f.missed_tick == k - 1 and f.reserve >= 1:
                    late += 1
                    # late again soon after the last: the reserve this makes is kept twice as long
                    again = k - f.late_tick <= lim.late_memory_ticks
                    hold = max(lim.spare_ticks, f.hold_ticks)
                    f.hold_ticks = min(2 * hold, lim.max_spare_ticks) if again else lim.spare_ticks
                    f.late_tick = k
                f.fed_tick, f.missed_tick = k, -2
                audio[s.slot] = frame
                arrived[s.slot] = s.inbox.popped_at
                f.frames_consumed += 1
                f.frames_replayed += quiet[s.slot]
        self.slipped.append(slips)
        return LivePlan(
            k, live, audio, force_text, force_func, reset, quiet, restore, arrived, tick.t_start, late
        )

    def apply_live(self, tick: Tick, plan: LivePlan, result: LiveResult) -> None:
        """The live step's frames, turns and calls out to their sessions (on the tick thread)."""
        for s in tick.sessions:
            if not plan.live[s.slot] or plan.quiet[s.slot]:
                continue
            out: list[Output] = []
            text, func = int(result.text[s.slot]), int(result.func[s.slot])
            turn = s.turn
            piece = self.tok.text(
                turn.text, text
            )  # whole characters only: a split one waits for its last byte
            if text == self.tok.bos and not turn.speaking:
                turn.speaking = True
                turn.turns += 1
                turn.started_at = plan.t_start
                turn.said.clear()
                out.append(TurnStarted(plan.tick))
            if piece and turn.speaking:
                turn.said.append(piece)  # mostly the vocabulary's own string: nothing is copied
            out.append(AudioFrame(plan.tick, result.audio[s.slot], piece))
            if text == self.tok.eos and turn.speaking:
                turn.speaking = False
                out.append(TurnEnded(plan.tick))
            if func == self.tok.call_start:
                if turn.speaking:  # a call interrupts the model's own turn
                    turn.speaking = False
                    out.append(TurnEnded(plan.tick))
                self.calls.start(s, plan.tick, out)
            s.deliver(out)

    # -- tool work in the slack -----------------------------------------------------------------------

    def next_tool_work(
        self,
        tick: Tick,
        budget_ms: float,
        skip: frozenset[str] = frozenset(),
        served: frozenset[str] = frozenset(),
    ) -> ToolWork | None:
        """The most urgent piece of slack work predicted to fit in budget_ms, or None.

        Priority: tool-call tokens (a caller is waiting), result prefill, replay, prompt prefill; but every
        kind not yet `served` this tick comes before a second piece of any kind, so a stream of call tokens
        never starves the catch-up. Kinds in `skip` are not planned (the cadence-locked baseline runs each
        kind at most once per tick).
        """
        by_phase: dict[Phase, list[Session]] = {}
        for s in tick.sessions:
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
            fit = largest_fit(self.costs, "call", len(calls), 1, budget_ms) if calls else None
            if not fit:
                return None
            return call_work(sorted(calls, key=lambda s: s.call.t_start)[: fit[0]])
        if kind == "replay":  # catch-up steps beyond the one the live batch gives, down to an empty inbox
            # several frames a row for sessions back from a tool (as many as the most held, at most
            # MAX_REPLAY_FRAMES; one until a replay is measured, so no long piece starts on a guess), the
            # one nearest its bound first
            back = [s for s in by_phase.get(Phase.REPLAY, []) if len(s.inbox) >= 1 + lim.reserve_frames]
            back.sort(key=lambda s: s.progress.live_by or 0)
            ready = back + [s for s in by_phase.get(Phase.LIVE, []) if s.feed.catch_up and len(s.inbox) >= 1]
            most = max((len(s.inbox) - lim.reserve_frames for s in back), default=1)
            frames = min(MAX_REPLAY_FRAMES, 1 << (most.bit_length() - 1)) if self.costs.knows(kind) else 1
            fit = largest_fit(self.costs, kind, len(ready), frames, budget_ms) if ready else None
            if not fit:
                return None
            return replay_work(ready[: fit[0]], self.S, self.frame_in, fit[1], lim.reserve_frames)
        phase, chunk = (
            (Phase.PREFILL, lim.result_chunk) if kind == "result" else (Phase.PROMPT, lim.prefill_chunk)
        )
        group = by_phase.get(phase, [])
        group = prompt_leaders(group, self.prompts) if kind == "prompt" else sorted(group, key=furthest_first)
        if not group:
            return None
        t_max = min(chunk, lim.max_chunk, *(s.prefill_stop for s in group))
        fit = largest_fit(self.costs, kind, len(group), t_max, budget_ms)
        return prefill_work(kind, group[: fit[0]], fit[1]) if fit else None

    def owed_work(self, tick: Tick) -> ToolWork | None:
        """The next piece of work due this tick, or None: the result positions due this tick, then the
        prompt positions, then a call-token step for sessions calling a tool that have not moved this tick
        (`owed_rows` rows at a time, the least recently served first). The results owed go in one piece,
        the prompts owed in pieces of `owed_rows`, each row with as many positions left. Results and prompts
        come first: their bounds are the ones a caller is promised. Catch-up is not forced: the replay bound
        holds by skipping held audio."""
        k, lim = tick.number, self.limits
        open_ = [s for s in tick.sessions if not s.closed]

        def first(group: list[Session]) -> list[Session]:
            return sorted(group, key=lambda s: (s.progress.tick, s.opened_at))

        if results := [s for s in open_ if s.phase is Phase.PREFILL and s.progress.owed > 0]:
            return self._owed_prefill("result", first(results))
        leaders = prompt_leaders([s for s in open_ if s.phase is Phase.PROMPT], self.prompts)
        if group := [s for s in leaders if s.progress.owed > 0]:
            return self._owed_prefill("prompt", first(group))
        if calls := [s for s in open_ if s.phase is Phase.TOOL_CALL and s.progress.tick != k]:
            return call_work(first(calls)[: lim.owed_rows])
        return None

    def _owed_prefill(self, kind: WorkKind, queue: list[Session]) -> ToolWork:
        """The positions the first of `queue` owes, with the next sessions of the queue that have as many
        positions left: for results every one of them, as one piece of rows x positions (a bucket's fixed
        cost paid once for all); for prompts up to `owed_rows` rows. The tick cuts either to fit its budget
        (`fit_work`)."""
        lim = self.limits
        T = owed_chunk(queue[:1], lim)
        group = [s for s in queue if s.prefill_stop >= T]
        group = group if kind == "result" else group[: lim.owed_rows]
        return prefill_work(kind, group, T)

    def apply_tool(
        self, tick: Tick, work: ToolWork, result: ToolResult, ms: float | None = None
    ) -> SlackOutcome:
        """Account one piece of slack work: positions advance, call tokens are read, finished prefills move
        on to replay; with `ms`, its cost is learned (the tick learns its device time after its fence
        instead). Returns what the engine acts on."""
        done = SlackOutcome()
        T = work.positions
        if ms is not None:
            self.costs.observe(work.kind, len(work.sessions), T, ms)
        k = tick.number
        for s in work.sessions:
            s.progress.tick = k
        if work.kind == "call":
            for s, token in zip(work.sessions, result.func, strict=True):
                if s.forcing.func:
                    s.forcing.func.popleft()
                if self.calls.token(s, k, int(token), done):  # refused: the rest of a forced call goes too
                    s.forcing.func.clear()
        elif work.kind in ("result", "prompt"):
            for s in work.sessions:
                p = s.progress
                p.prefill_pos += T
                p.owed -= T
                if work.kind == "prompt" and p.prefill_pos == s.prefix_len < len(p.prefill_ids):
                    self._keep(s, s.prefix_key, done)  # the prefix, shared whatever follows it
                if p.prefill_pos < len(p.prefill_ids):
                    continue
                if work.kind == "result":  # back from a tool: the held audio is replayed within the bound
                    s.enter(Phase.REPLAY, k, by=k + self.limits.replay_ticks)
                    continue
                if s.keep_prompt:
                    self._keep(s, s.prompt_key, done)
                s.enter(Phase.REPLAY, k)
        return done

    def _keep(self, s: Session, key: int, done: SlackOutcome) -> None:
        """The state `s` has just prefilled is `key`'s: the engine has the runner keep it, once."""
        if key not in self.prompts and all(k != key for _, k in done.saves):
            done.saves.append((s.slot, key))
