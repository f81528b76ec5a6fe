"""What the serving benchmarks add to the engine's tick ledger (engine/tick/ledger.py): the audible gaps each
caller would meet, and the tick plot that stacks every tick's parts.

A late tick is a gap only where it outruns the playout's lead: the caller's player holds `lead_ms` of audio
ahead when a stretch of speech starts, plays a frame every tick, and a frame that comes after its turn to be
played leaves a gap as long as it is late (the player then starts again from that frame). Knows frames' times
and the ledger's series; nothing of the engine.
"""

from __future__ import annotations

import numpy as np

from engine.tick.ledger import SIDE_KINDS

TICK_MS = 80.0


class PlayoutGaps:
    """Per session: `frame(tick, t)` for each output frame as it is handed out (t in seconds)."""

    def __init__(self, lead_ms: float = TICK_MS, tick_ms: float = TICK_MS) -> None:
        self.lead_s, self.tick_s = lead_ms / 1000, tick_ms / 1000
        self._due: dict[object, float] = {}
        self._last: dict[object, int] = {}
        self.gaps: dict[object, int] = {}
        self.gap_ms: dict[object, float] = {}

    def frame(self, session: object, tick: int, t: float) -> None:
        due = self._due.get(session)
        if due is None or tick != self._last.get(session, -2) + 1:
            due = t + self.lead_s  # a new stretch: playout starts behind its lead
        elif t > due:  # later than the caller's ear needed it: a gap
            self.gaps[session] = self.gaps.get(session, 0) + 1
            self.gap_ms[session] = self.gap_ms.get(session, 0.0) + (t - due) * 1e3
            due = t
        self._due[session] = due + self.tick_s
        self._last[session] = tick

    def report(self, sessions: list[object]) -> dict:
        return {
            "playout_lead_ms": round(self.lead_s * 1e3, 3),
            "sessions_with_gaps": sum(self.gaps.get(s, 0) > 0 for s in sessions),
            "gaps": sum(self.gaps.get(s, 0) for s in sessions),
            "gap_ms_max_session": round(max((self.gap_ms.get(s, 0.0) for s in sessions), default=0.0), 3),
            "per_session": [
                {"gaps": self.gaps.get(s, 0), "gap_ms": round(self.gap_ms.get(s, 0.0), 3)} for s in sessions
            ],
        }


def plot_ticks(series: dict[str, list[float]], path: str, title: str, frame_ms: float = TICK_MS) -> None:
    """Every tick's parts stacked (the live step's wait for earlier work, the live step, the side work on
    the device by kind, the host's work) against the frame's deadline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e})") from None
    kinds = [k for k in SIDE_KINDS if f"side_{k}" in series]
    sides = [f"side_{k}" for k in kinds] or ["side"]
    names = ("wait", "live", *sides, "host")
    labels = (
        "live step waiting",
        "live step",
        *(f"{k} pieces (device)" for k in kinds or ["side work"]),
        "host",
    )
    x = np.asarray(series["tick"]) * frame_ms / 1000  # the ticks the ledger kept (the latest)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(x, *(np.asarray(series[k]) for k in names), labels=labels, lw=0)
    ax.axhline(frame_ms, color="red", ls="--", label=f"{frame_ms:g} ms deadline")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
