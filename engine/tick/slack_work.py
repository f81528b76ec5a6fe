"""The pieces of paused work a tick's slack runs, sized and made: the largest batch of a kind the cost model
predicts to fit a budget, the one session that prefills each prompt state being made, and the `ToolWork`
each kind becomes (its rows' slots and tokens; for catch-up, the frames it takes from the inboxes, counted).

Runs on the tick thread, for the scheduler (engine/tick/scheduler.py), which decides which work runs and when.
CPU-only and model-free: it works on numpy arrays. Knows the sessions' progress, inboxes and forced tokens,
and which prompt states the cache holds; knows nothing of the model, the clock or the tick's deadline.
"""

from __future__ import annotations

import numpy as np

from engine.tick.graph import pow2_at_least
from engine.tick.plan import CostModel, Limits, ToolWork, WorkKind
from engine.tick.prompt_cache import PromptCache
from engine.tick.session import Phase, Session


def largest_fit(costs: CostModel, kind: str, n: int, t_max: int, budget_ms: float) -> tuple[int, int] | None:
    """The largest (rows, positions) of this kind predicted to fit in the budget: halve the positions
    first (keeps every row moving), then the rows."""
    b = n
    while b >= 1:
        t = t_max
        while t >= 1:
            if costs.predict(kind, b, t) <= budget_ms:
                return b, t
            t //= 2
        b //= 2
    return None


def prompt_leaders(prompting: list[Session], prompts: PromptCache) -> list[Session]:
    """One session per distinct uncached prompt state being made (a prefix, or a whole prompt), the
    furthest along: it prefills, and the others making the same start from its state once it is cached."""
    leaders: dict[int, Session] = {}
    for s in sorted(prompting, key=furthest_first):
        if (key := s.prefill_key) not in prompts:
            leaders.setdefault(key, s)
    return list(leaders.values())


def owed_chunk(group: list[Session], limits: Limits) -> int:
    return min(
        limits.max_chunk,
        max(s.progress.owed for s in group),
        *(s.prefill_stop for s in group),
    )


def prefill_work(kind: WorkKind, group: list[Session], T: int) -> ToolWork:
    ids = np.array([s.progress.upcoming(T) for s in group], dtype=np.int64)
    return ToolWork(kind, group, _slots(group), ids)


def replay_work(group: list[Session], S: int, frame_in: int, frames: int = 1, reserve: int = 0) -> ToolWork:
    """A catch-up piece over `group`: one held frame a row, or with `frames` > 1 up to that many for a
    session back from a tool (never its last `reserve`; a live session's catch-up is one frame), as
    [frames, S, frame_in] audio and a [frames, S] mask (frame j of a row replayed where it is set)."""
    shape = (frames, S) if frames > 1 else (1, S)
    audio = np.zeros((*shape, frame_in), dtype=np.float32)
    active = np.zeros(shape, dtype=bool)
    for s in group:
        n = min(frames, len(s.inbox) - reserve) if s.phase is Phase.REPLAY else 1
        for j in range(n):
            audio[j, s.slot] = s.inbox.pop()
        active[:n, s.slot] = True
        f = s.feed
        f.frames_consumed += n
        f.frames_replayed += n
        if s.phase is Phase.LIVE:
            f.catch_up = False
            f.caught_up += 1
    if frames == 1:  # one frame a row: the live step's own shapes
        audio, active = audio[0], active[0]
    return ToolWork("replay", group, _slots(group), np.zeros((len(group), 0), np.int64), audio, active)


def furthest_first(s: Session) -> tuple[int, float]:
    return -s.progress.prefill_pos, s.opened_at


def call_work(group: list[Session]) -> ToolWork:
    """One call-token step for `group`, with each session's forced function token (-1: the model's own)."""
    forced = np.array([[s.forcing.func[0] if s.forcing.func else -1] for s in group], dtype=np.int64)
    return ToolWork("call", group, _slots(group), forced)


def _slots(sessions: list[Session]) -> np.ndarray:
    return np.array([s.slot for s in sessions], dtype=np.int64)


def fit_work(costs: CostModel, work: ToolWork, budget_ms: float) -> ToolWork | None:
    """Owed call or prefill `work` cut to the largest piece predicted to fit `budget_ms`: rows halved first
    (the first row is the one most owed), then the positions of one row; None where not even one fits."""
    T = work.tokens.shape[1] if work.kind in ("result", "prompt") else 1
    b = len(work.sessions)
    while b > 1 and costs.predict(work.kind, b, T) > budget_ms:
        b //= 2
    while T > 1 and costs.predict(work.kind, b, T) > budget_ms:
        T = pow2_at_least(T) // 2
    return cut_work(work, b, T) if costs.predict(work.kind, b, T) <= budget_ms else None


def cut_work(work: ToolWork, rows: int, positions: int) -> ToolWork:
    """The first `rows` sessions of call or prefill `work`, a prefill's first `positions` positions."""
    T = work.tokens.shape[1] if work.kind in ("result", "prompt") else 1
    if rows >= len(work.sessions) and positions >= T:
        return work
    if work.kind == "call":
        return call_work(work.sessions[:rows])
    return prefill_work(work.kind, work.sessions[:rows], min(positions, T))
