"""Every tick's device time, accounted: the live step, the time it waited for earlier work, each piece of
side work (kind, rows x positions, predicted and measured), the host's time between them, and how far the
tick's end fell past its deadline and why.

Filled by the tick (engine/tick/ticker.py) once per tick, after its fence, from the runner's device times
(engine/tick/device_time.py); read by the serving benchmarks (`report`) and their tick plot, and off the tick
thread by the snapshot and `/metrics` (`report` again: it copies what it reads first, each copy one call that
the tick thread cannot interleave, and nothing of it runs on the tick). Bounded: the last `keep` ticks, the
last `keep_missed` missed ones, the last `keep_pieces` pieces of each bucket; the totals are counts. Knows
numbers; nothing of the model or of sessions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

SIDE_KINDS = ("call", "result", "replay", "prompt")  # engine/tick/plan.py `PRIORITY`, in its order


@dataclass(slots=True)
class Piece:
    kind: str
    rows: int
    positions: int
    predicted_ms: float
    device_ms: float = float("nan")
    owed: bool = False  # forced by a bound, not chosen to fit the slack
    forced: bool = False  # run though predicted not to fit: owed work that had fitted nowhere for ticks


@dataclass(slots=True)
class TickRecord:
    tick: int
    live_ms: float  # the live step on the device
    wait_ms: float  # the live step's host time beyond its device time: earlier work it waited for
    side_ms: float  # the side pieces on the device
    host_ms: float  # the rest of the tick: the host's planning and bookkeeping
    late_ms: float  # the tick's end past its deadline (negative: to spare)
    pieces: list[Piece] = field(default_factory=list)
    why: str = ""  # for a late tick: what made it late


class Ledger:
    def __init__(self, keep: int = 4096, keep_missed: int = 256, keep_pieces: int = 1024) -> None:
        self.ticks: deque[TickRecord] = deque(maxlen=keep)
        self.missed: deque[TickRecord] = deque(maxlen=keep_missed)
        self.late = 0
        self.late_ms_max = 0.0
        self.by_bucket: dict[str, tuple[deque[float], deque[float]]] = {}
        self.pieces_run: dict[str, int] = {}  # every piece recorded, by bucket
        self.late_ran: dict[str, int] = {}  # the pieces that ran in late ticks, by kind
        self._keep_pieces = keep_pieces

    def record(self, rec: TickRecord) -> None:
        self.ticks.append(rec)
        for p in rec.pieces:
            key = f"{p.kind}/{p.rows}x{p.positions}"
            pair = self.by_bucket.get(key)
            if pair is None:
                pair = self.by_bucket[key] = (
                    deque(maxlen=self._keep_pieces),
                    deque(maxlen=self._keep_pieces),
                )
            pair[0].append(p.predicted_ms)
            pair[1].append(p.device_ms)
            self.pieces_run[key] = self.pieces_run.get(key, 0) + 1
        if rec.late_ms > 0:
            self.late += 1
            self.late_ms_max = max(self.late_ms_max, rec.late_ms)
            self.missed.append(rec)
            for p in rec.pieces:
                self.late_ran[p.kind] = self.late_ran.get(p.kind, 0) + 1

    def report(self, missed_shown: int = 20) -> dict:
        """The figures the serving benchmarks print: per bucket predicted and measured ms (p50, p99), the
        live step and its wait, and the latest late ticks with what ran in each. Safe off the tick thread:
        each deque and dict is copied (one call each) before it is read."""
        ticks = list(self.ticks)
        by_bucket = [(key, list(pred), list(meas)) for key, (pred, meas) in list(self.by_bucket.items())]
        run, late_ran, missed = dict(self.pieces_run), dict(self.late_ran), list(self.missed)

        def pcts(xs) -> dict[str, float | None]:
            if not len(xs):
                return {"p50": None, "p99": None, "max": None}
            a = np.asarray(xs, dtype=np.float64)
            return {
                k: round(float(np.percentile(a, q)), 3) for k, q in (("p50", 50), ("p99", 99), ("max", 100))
            }

        buckets = {}
        for key, pred, meas in sorted(by_bucket):
            p, m = pcts(pred), pcts(meas)
            buckets[key] = {
                "n": len(meas),
                "run": run.get(key, len(meas)),
                "predicted_ms_p50": p["p50"],
                "predicted_ms_p99": p["p99"],
                "measured_ms_p50": m["p50"],
                "measured_ms_p99": m["p99"],
            }
        return {
            "ticks": len(ticks),
            "live_ms": pcts([t.live_ms for t in ticks]),
            "live_wait_ms": pcts([t.wait_ms for t in ticks]),
            "side_ms": pcts([t.side_ms for t in ticks]),
            "host_ms": pcts([t.host_ms for t in ticks]),
            "late_ticks": self.late,
            "late_ms_max": round(self.late_ms_max, 3),
            "late_ran": late_ran,
            "pieces": buckets,
            "missed": [
                {
                    "tick": t.tick,
                    "late_ms": round(t.late_ms, 3),
                    "live_ms": round(t.live_ms, 3),
                    "wait_ms": round(t.wait_ms, 3),
                    "why": t.why,
                    "ran": [
                        {
                            "kind": p.kind,
                            "rows": p.rows,
                            "positions": p.positions,
                            "predicted_ms": round(p.predicted_ms, 3),
                            "device_ms": round(p.device_ms, 3),
                            "owed": p.owed,
                        }
                        for p in t.pieces
                    ],
                }
                for t in missed[-missed_shown:]
            ],
        }

    def series(self) -> dict[str, list[float]]:
        """Per tick kept, in order: its number and the parts the tick plot stacks; the side work also by
        kind (`side_call`, `side_result`, `side_replay`, `side_prompt`: the device time of its pieces)."""
        ticks = list(self.ticks)
        out = {
            "tick": [t.tick for t in ticks],
            "wait": [t.wait_ms for t in ticks],
            "live": [t.live_ms for t in ticks],
            "side": [t.side_ms for t in ticks],
            "host": [t.host_ms for t in ticks],
        }
        for kind in SIDE_KINDS:
            out[f"side_{kind}"] = [sum(p.device_ms for p in t.pieces if p.kind == kind) for t in ticks]
        return out
