"""How late the model's frames come, how a played chunk is made shorter, and what the pacing sleeps on: the
measurements, the one sound operation and the one wait the playout (agent/audio_out/playout_buffer.py) is made
of. Knows samples, seconds and the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

MAX_START_DELAY_FRAMES = 3  # the start delay never grows beyond this (a machine this late gaps instead)
MIN_START_DELAY_S = 0.01  # nor shrinks below this (the sink's own handover)
JITTER_MARGIN_S = 0.01  # added to the lateness measured
JITTER_WINDOW_S = 8.0  # lateness is remembered this long (a peak's, as long as peaks recur)
JITTER_WARMUP = 24  # frames measured (about two seconds of speech) before the delay follows them
# a frame later than the window's median lateness by more than PEAK_S is a peak: the delay covers it for
# PEAK_HOLD_S after it, or for twice the longest interval between the window's peaks when they recur (at most
# the window), as NetEQ's peak detector covers peaks only while they keep their period: a burst of late frames
# (another call's process starting beside this one) is not paid for in every frame of the next 8 seconds
PEAK_S = 0.02
PEAK_HOLD_S = 1.5


class ArrivalJitter:
    """How late the frames of the model's turns arrive behind their cadence, and the start delay that this
    needs, as WebRTC's NetEQ sizes its buffer from packet arrivals.

    Within a turn the k-th frame plays k frames after the first one, so it is late by how far behind that
    cadence it arrived (what the first frame's start delay must cover for it to play without a gap); the
    cadence is the earliest one of the turn's frames in the last `window_s` (a tick that moved for good is a
    new cadence once the old frames have left the window). The delay covers the lateness of the window's
    frames plus a margin, within [MIN_START_DELAY_S, MAX_START_DELAY_FRAMES frames]: a late frame raises it
    at once; a peak (PEAK_S beyond the window's median) is covered for PEAK_HOLD_S, or for twice the longest
    interval between the window's peaks while they recur; the rest for the whole window. Until `warmup`
    frames have been measured it is `initial_s`. Times are the caller's clock (any monotonic seconds)."""

    def __init__(
        self,
        frame_s: float,
        initial_s: float,
        *,
        window_s: float = JITTER_WINDOW_S,
        warmup: int = JITTER_WARMUP,
    ) -> None:
        self.frame_s, self.initial_s, self.window_s, self.warmup = frame_s, initial_s, window_s, warmup
        self.max_s = MAX_START_DELAY_FRAMES * frame_s
        self.measured = 0
        self._seen: deque[tuple[float, float]] = deque()  # (arrival, lateness) of the window's frames
        self._dues: deque[tuple[float, float]] = deque()  # the turn's cadence: (arrival, due), due increasing
        self._k = 0

    def begin_turn(self) -> None:
        self._dues.clear()
        self._k = 0

    def observe(self, arrived: float) -> float:
        """A frame of the current turn arrived at `arrived`; returns its lateness (seconds)."""
        due = arrived - self._k * self.frame_s  # when the first frame would have come, by this one's cadence
        self._k += 1
        dues = self._dues
        # the turn's earliest cadence in the window (a monotonic queue: its minimum in O(1)): frames that come
        # earlier than the first did (the tick moved toward the callers' frames, engine/tick/phase.py) set the
        # cadence the later ones are late for
        while dues and dues[0][0] < arrived - self.window_s:
            dues.popleft()
        while dues and dues[-1][1] >= due:
            dues.pop()
        dues.append((arrived, due))
        late = max(0.0, due - dues[0][1])
        self.measured += 1
        self._seen.append((arrived, late))
        return late

    def lateness(self, now: float) -> float:
        """The lateness the delay covers at `now`: the window's frames, its peaks while they are held."""
        seen = self._seen
        while seen and seen[0][0] < now - self.window_s:
            seen.popleft()
        if not seen:
            return 0.0
        lates = sorted(late for _, late in seen)
        limit = lates[len(lates) // 2] + PEAK_S
        base, last, longest, peaks = 0.0, None, 0.0, []
        for arrived, late in seen:
            if late <= limit:
                base = max(base, late)
                continue
            if last is not None:
                longest = max(longest, arrived - last)
            last = arrived
            peaks.append((arrived, late))
        hold = min(self.window_s, max(PEAK_HOLD_S, 2.0 * longest))
        return max([base] + [late for arrived, late in peaks if arrived >= now - hold])

    def delay(self, now: float) -> float:
        if self.measured < self.warmup:
            return self.initial_s
        return min(self.max_s, max(MIN_START_DELAY_S, self.lateness(now) + JITTER_MARGIN_S))


def shorten(x: np.ndarray, n: int, fade: int) -> np.ndarray:
    """`x` (int16) without `n` samples: the quietest stretch of that length goes, and the samples either side
    of it are crossfaded over `fade` samples, so no click is heard where it went."""
    fade = max(1, min(fade, (x.size - n) // 2))
    if n <= 0 or x.size < n + 2 * fade:
        return x
    f = x.astype(np.float32)
    energy = np.concatenate([[0.0], np.cumsum(f * f)])
    # the stretch [p, p + n + fade) whose energy is least, within the chunk
    span = n + fade
    p = int(np.argmin(energy[span:] - energy[:-span]))
    ramp = np.linspace(0.0, 1.0, fade, dtype=np.float32)
    joined = f[p : p + fade] * (1.0 - ramp) + f[p + n : p + n + fade] * ramp
    return np.concatenate([x[:p], np.round(joined).astype(np.int16), x[p + n + fade :]])


class Wake:
    """What a pacing loop sleeps on: `set` wakes a `sleep` in progress (one set while none is in progress is
    not kept), or its timeout does. One future and one timer a sleep, where `asyncio.wait_for` on an event
    makes a task and, on every timeout, a cancellation and an exception: the pacing sleeps twice a frame."""

    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    def set(self) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)

    async def sleep(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._fut = fut = loop.create_future()
        timer = None if timeout is None else loop.call_later(max(0.0, timeout), _wake_up, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._fut = None


def _wake_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
