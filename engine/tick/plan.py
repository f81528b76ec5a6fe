"""The types the scheduler hands the runner and the engine, one tick's worth: the tick itself, the live
batch's inputs and outputs, a piece of paused work and its result, what that work finished, the limits that
bound each phase, and the cost model that decides what fits in a tick's slack."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from engine.tick.buckets import work_buckets
from engine.tick.session import Session

WorkKind = Literal["call", "result", "replay", "prompt"]
PRIORITY: tuple[WorkKind, ...] = ("call", "result", "replay", "prompt")


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
    # a live session that had a frame to spare at this many ticks in a row (1 s) sheds one silent frame: a
    # reserve that steady arrivals never touch is latency, not a jitter buffer (a late frame puts it back)
    spare_ticks: int = 12
    # a late arrival within this many ticks (8 s, the playout's jitter window) of the last one doubles how
    # long the reserve it makes is kept, up to this many ticks: arrivals late again and again keep their
    # reserve, as NetEQ keeps a buffer for the jitter it keeps seeing, where one late frame costs 1 s of it
    late_memory_ticks: int = 100
    max_spare_ticks: int = 100
    # caller frames a caught-up session keeps in reserve (0: none until a late arrival makes one; 1 is the
    # fixed-buffer baseline, EngineConfig.fixed_buffers)
    reserve_frames: int = 0
    # a reserve is caught up only outside the agent's turns (a quiet step would cut its speech), except in
    # echo mode, where the turn is nominal and the echoed frame is all there is (engine/tick/echo.py)
    catch_up_in_turns: bool = False


@dataclass(slots=True)
class Tick:
    """One tick as the engine drives it: its number, when it started and the sessions open at its start. Made
    by `Scheduler.begin_tick` and passed to every scheduler call of the tick; nothing keeps it after."""

    number: int
    sessions: list[Session]
    t_start: float = float("nan")  # the engine's clock


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
    arrived: np.ndarray | None = None  # [S] float64: when the row's frame arrived (NaN: no frame)
    t_start: float = float("nan")  # when the tick started (the engine's clock)
    late: int = 0  # sessions whose frame for the last tick came after it (found by this plan)


@dataclass
class LiveResult:
    text: np.ndarray  # [S] int64
    func: np.ndarray  # [S] int64
    audio: np.ndarray  # [S, 1764] float32


class TickObserver(Protocol):
    """What watches every tick from outside the plan (echo mode, engine/tick/echo.py): `live` is given the
    live step's result before its frames go out (and may replace them), `sent` the time they went out. The
    engine holds none unless one is configured, so a tick without one calls nothing."""

    def live(self, tick: Tick, plan: LivePlan, result: LiveResult) -> None: ...

    def sent(self, t: float) -> None: ...


@dataclass
class ToolWork:
    """One piece of slack work over a batch of paused slots."""

    kind: WorkKind
    sessions: list[Session]
    slots: np.ndarray  # [b] int64
    tokens: np.ndarray  # call: forced func token [b, 1] (-1 none); result/prompt: ids [b, T]; replay: unused
    # replay: [S, 1280] with the replayed frames in the replaying rows, or [k, S, 1280] for k frames a row
    audio: np.ndarray | None = None
    active: np.ndarray | None = None  # replay: [S] bool, or [k, S] (frame j of the row replayed)

    @property
    def positions(self) -> int:
        """Positions a row advances: a prefill's tokens, a replay's frames, one call token."""
        if self.kind in ("result", "prompt"):
            return self.tokens.shape[1]
        if self.kind == "replay" and self.audio is not None and self.audio.ndim == 3:
            return self.audio.shape[0]
        return 1


@dataclass
class ToolResult:
    func: np.ndarray | None = None  # call: [b] int64 tokens produced


@dataclass
class SlackOutcome:
    """What one piece of slack work finished that the engine acts on."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, prompt key): prompt states to keep
    calls: list[tuple[float, int]] = field(default_factory=list)  # (ms, ticks) per call the model has written


@dataclass
class CostModel:
    """Predicted device milliseconds per piece of slack work, learned per kind and shape (rows padded to a
    power of two, positions) from the device time of every piece run (engine/tick/device_time.py: CUDA
    events on a GPU, never the time to launch it) and of each bucket at warm-up: a high percentile
    (`quantile`) of the last `window` measurements, so a piece starts only where its slow runs fit too, and
    one outlier ages out of the window instead of locking the estimate high."""

    default_ms: float = 5.0
    quantile: float = 95.0
    window: int = 64
    table: dict[tuple[str, int, int], float] = field(default_factory=dict)  # the prediction per shape
    _seen: dict[tuple[str, int, int], deque[float]] = field(default_factory=dict)
    _raw: dict[tuple[str, int, int], float] = field(default_factory=dict)  # each bucket's own measurements
    _ratios: dict[str, deque[float]] = field(default_factory=dict)
    _drift: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def _key(kind: str, b: int, t: int) -> tuple[str, int, int]:
        bucket = 1 << max(0, (b - 1).bit_length())  # 1, 2, 4, 8, ...
        return kind, bucket, t

    def predict(self, kind: str, b: int, t: int = 1) -> float:
        """A piece of `kind` over `b` rows and `t` positions: the sum of the buckets it runs
        (engine/tick/buckets.py)."""
        return sum(self.bucket(*key) for key in work_buckets(kind, b, t))

    def knows(self, kind: str) -> bool:
        """Whether a bucket of `kind` has been measured (else its predictions are `default_ms`, a guess)."""
        return any(k == kind for k, _, _ in self.table)

    def bucket(self, kind: str, b: int, t: int = 1) -> float:
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

    def observe(self, kind: str, b: int, t: int, ms: float, stale: bool = False) -> None:
        """One measurement of bucket (kind, b, t). A bucket predicts the larger of its window's percentile
        and its last RECENT measurements, so a device that turned slower is planned for at once; and every
        bucket of the kind is scaled by the median of the kind's last DRIFT measurements over their buckets'
        own predictions (when above 1), so buckets not measured since are planned slower too (they run on
        the same device). A median of ratios, not a product: one slow outlier moves nothing. `stale`: the
        piece ran though predicted not to fit (the tick's progress guarantee): where it took less than its
        bucket's own measurements say, every measurement of its kind is scaled down by that ratio, for
        they were made in conditions that no longer hold (a burst of load at warm-up), and no bucket
        predicted too slow to fit would ever run again to be measured anew."""
        key = self._key(kind, b, t)
        if stale:
            own = self._raw.get(key)
            if own and ms < own:
                ratio = ms / own
                for other, seen in self._seen.items():
                    if other[0] == kind:
                        self._seen[other] = deque((v * ratio for v in seen), maxlen=self.window)
                for other in [o for o in self._raw if o[0] == kind]:
                    self._raw[other] *= ratio
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self.window)
        prior = self._raw.get(key)
        if prior is not None and prior > 0:
            ratios = self._ratios.get(kind)
            if ratios is None:
                ratios = self._ratios[kind] = deque(maxlen=DRIFT)
            ratios.append(ms / prior)
            self._drift[kind] = max(1.0, float(np.median(ratios)))
        seen.append(ms)
        recent = max(seen[i] for i in range(-min(RECENT, len(seen)), 0))
        self._raw[key] = max(float(np.percentile(seen, self.quantile)), recent)
        drift = self._drift.get(kind, 1.0)
        for other, raw in self._raw.items():
            if other[0] == kind:
                self.table[other] = raw * drift


RECENT = 4  # a bucket's last measurements that its prediction never falls below
DRIFT = 8  # a kind's last measurements whose ratios to their predictions scale the kind's buckets
