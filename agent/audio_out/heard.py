"""What a caller hears of the agent's turns: the gaps in its audio beyond its own pauses, and the frames that
came late but that the playout's lead covered.

Within a turn each frame is due at the ear when the one before it ends. A frame that came behind its turn's
cadence (`ArrivalJitter.observe`'s lateness) is heard without a break as long as the audio queued ahead of
it lasted until it came: the playout buffer absorbed it. Where its lateness outran that lead, the audio
before it ran out and the caller heard silence until it started: a gap. The pauses between turns (the agent
not speaking) are neither. For the latency benchmark (echo mode) a call can also keep each frame's arrival
and start and log them when it closes (`keep_times`). Knows seconds; nothing of samples, sinks or rooms.
"""

from __future__ import annotations

import logging
import math
from collections import deque

log = logging.getLogger("chorus.agent.heard")

LATE_S = 0.005  # a frame this far behind its turn's cadence came late (the pacing's own slack is below it)
JOINED_S = 1e-4  # a frame that starts within this of the one before's end joins it: no gap
KEEP_TIMES = 2048  # frames whose times a measured call keeps (the last 164 s)


class HeardCounter:
    """Per call: `gaps` and `gap_s` (the silences heard inside turns), `absorbed` (late frames heard without
    one), `late` (every late frame, absorbed or not)."""

    def __init__(self, late_s: float = LATE_S) -> None:
        self.late_s = late_s
        self.gaps = 0
        self.gap_s = 0.0
        self.absorbed = 0
        self.late = 0
        self.times: deque[tuple[float, float]] | None = None  # (arrived, started) per frame, when kept
        self._label = ""

    def keep_times(self, label: str) -> None:
        """Keep each frame's arrival and start (time.monotonic), logged by `close` under the call's `label`
        (its pseudonym, as the monitoring page shows it): a measurement tool, for echo mode only."""
        self.times, self._label = deque(maxlen=KEEP_TIMES), label

    def close(self) -> None:
        """The call's playout closes: its kept times, if any, in one log line: the first arrival, then per
        frame its arrival after the one before and its wait to start, in tenths of a millisecond (no number
        of seven digits, which the log's privacy filter would take for a phone number and mask)."""
        if not self.times:
            return
        base, before, items = self.times[0][0], self.times[0][0], []
        for arrived, started in self.times:
            items.append(f"{round((arrived - before) * 1e4)}w{round((started - arrived) * 1e4)}")
            before = arrived
        hours, rest = divmod(base, 3600.0)
        seconds, frac = divmod(rest, 1.0)
        log.info(
            "playout frames of %s from %dh %ds %.1fms: %s",
            self._label,
            hours,
            seconds,
            frac * 1e3,
            ";".join(items),
        )

    def frame(self, late_s: float, due: float | None, start: float, arrived: float = math.nan) -> bool:
        """A frame `late_s` behind its turn's cadence, which arrived at `arrived`, starts playing at `start`;
        the turn's audio before it ran until `due` (None: the turn's first frame, due whenever it comes).
        True when it was a gap."""
        if self.times is not None:
            self.times.append((arrived, start))
        late = late_s > self.late_s
        self.late += late
        if due is not None and start > due + JOINED_S:
            self.gaps += 1
            self.gap_s += start - due
            return True
        self.absorbed += late
        return False
