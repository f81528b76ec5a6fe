"""Echo mode (`EngineConfig(echo=True)`, the worker's CHORUS_ECHO=true): a measurement tool,
never for callers.

The tick runs as always (the live step over every live slot, on the real model or dummy weights), but each
live slot's output frame is replaced by its own input frame of the same tick: 1280 samples at 16 kHz resampled
(linearly) to the output's 1764 at 22.05 kHz, so a sample at position p of the input frame is heard at
position p * 1764 / 1280 of the output frame. The text channel reads start-of-turn on every live row (no text
piece: the turn never ends, so the agent's turn gate passes the echoed audio without a break) and the function
channel reads PAD (no tool call ever starts). The model's own state moves on with its own tokens; only what
leaves the tick is replaced.

Timing for benchmarks/livekit_latency.py: an input frame with a sample above `MARK` (full scale 1.0) is
*marked*; for each marked frame the snapshot's `echo` list keeps (newest `KEEP`) when it arrived (its room
wrote it to shared memory, or it was pushed into the session's inbox: `FrameInbox.popped_at`), when the tick
that consumed it started, when its output frame was handed to the session, where in the frame the mark
begins, how many of its samples are above the mark, and its peak. With echo off nothing here runs.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.config.stage_config import ClockConfig
from engine.text.tokens import Tokens
from engine.tick.plan import LivePlan, LiveResult, Tick

MARK = 0.25  # an input sample louder than this marks its frame (about -12 dBFS)
KEEP = 8192  # marked frames kept for the snapshot (newest)


class Echo:
    """A tick observer (engine/tick/plan.py `TickObserver`): replaces a tick's live output by its input
    (`live`, before the scheduler scatters it) and logs marked frames' timings (`sent`, once the frames are
    handed out)."""

    def __init__(self, clock: ClockConfig, tokens: Tokens, keep: int = KEEP) -> None:
        n_in, n_out = clock.input_samples, clock.output_samples
        pos = np.arange(n_out) * (n_in / n_out)  # output sample j is input time j * n_in / n_out
        self._i0 = np.minimum(np.floor(pos).astype(np.int64), n_in - 1)
        self._i1 = np.minimum(self._i0 + 1, n_in - 1)
        self._w = (pos - self._i0).astype(np.float32)
        self.ratio = n_out / n_in
        self.text, self.func = tokens.bos, tokens.pad
        self.records: deque[dict] = deque(maxlen=keep)
        self._pending: list[dict] = []
        self.marked = 0  # marked frames seen (also those beyond `keep`)

    def resample(self, audio: np.ndarray) -> np.ndarray:
        """[S, n_in] -> [S, n_out], linear interpolation."""
        return audio[:, self._i0] * (1.0 - self._w) + audio[:, self._i1] * self._w

    def live(self, tick: Tick, plan: LivePlan, result: LiveResult) -> None:
        result.audio[:] = self.resample(plan.audio)
        result.text[plan.live] = self.text
        result.func[:] = self.func
        loud = np.abs(plan.audio) > MARK
        heard = plan.live if plan.quiet is None else plan.live & ~plan.quiet
        hot = np.flatnonzero(heard & loud.any(axis=1))
        if not hot.size:
            return
        by_slot = {s.slot: s for s in tick.sessions if not s.closed}
        for slot in hot.tolist():
            s = by_slot.get(slot)
            if s is None:
                continue
            inbox = s.inbox
            self._pending.append(
                {
                    "session": s.id,
                    "label": s.label,
                    "tick": plan.tick,
                    "pushed": inbox.popped_at,
                    "tick_start": tick.t_start,
                    "sent": None,
                    "onset": int(np.argmax(loud[slot])),
                    "loud": int(loud[slot].sum()),
                    "peak": round(float(np.abs(plan.audio[slot]).max()), 3),
                    "backlog": inbox.held,
                }
            )
        self.marked += len(self._pending)

    def sent(self, t: float) -> None:
        """The tick's output frames were handed to their sessions at `t`."""
        if self._pending:
            for r in self._pending:
                r["sent"] = t
            self.records.extend(self._pending)
            self._pending = []

    def snapshot(self) -> dict:
        return {"mark": MARK, "ratio": self.ratio, "marked": self.marked, "frames": list(self.records)}
