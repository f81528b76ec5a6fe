"""The tick's phase against the callers' frames: ticks start soon after the frames they take have arrived.

A caller frame that arrives just after a tick started waits almost a whole tick for the next one (80 ms of
mouth to ear); one that arrives just before waits nothing. Where in the 80 ms a room's frames arrive is set by
the caller's clock and the network, not by the engine, so `TickPhase` moves the tick instead: it watches how
long before each tick its frames arrived (the *lead*, modulo the tick) and, while every frame of the last
`window` ticks led by more than the margin, starts the ticks earlier, at most `step_s` a tick. The margin is
the leads' own spread over the window (the arrivals' jitter) and at least `min_margin_s`, so a frame that
arrives a little late still makes its tick.

Moving ticks earlier only ever shortens the leads, so no frame that made its tick is pushed out of it. With
many rooms some frame arrives just before every tick (the smallest lead is near zero) and nothing moves; with
one caller, or rooms whose frames arrive together, the wait for the tick goes from up to a tick to the margin.
If the arrivals drift later past the tick (a caller's clock slower than the server's), their frames wait a
tick (a late arrival: counted as an underrun, and the frame kept in reserve) and the leads, now near a tick,
draw the ticks earlier again until they are locked on. Knows numpy; nothing of sessions or the model.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.api import MIN_MARGIN_S

WINDOW_TICKS = 25  # 2 s of ticks: every frame of them must have led by more than the margin
STEP_S = 0.01  # the most the tick moves in one tick
MAX_MARGIN_S = 0.04  # the margin a run of missed ticks can raise it to
CALM_TICKS = 375  # 30 s without a frame missing its tick: the raised margin halves


class TickPhase:
    """How much earlier than its nominal time (`t0 + k * tick`) each tick starts: `shift_s`, only growing
    while the frames' leads allow (`observe` once a tick, with the leads of the frames the tick took)."""

    def __init__(
        self,
        tick_s: float,
        window: int = WINDOW_TICKS,
        min_margin_s: float = MIN_MARGIN_S,
        step_s: float = STEP_S,
    ) -> None:
        self.tick_s = tick_s
        self.min_margin_s = min_margin_s
        self.step_s = step_s
        self.shift_s = 0.0
        self.floor_s = min_margin_s  # the margin's least: raised by missed ticks, back down in calm
        self.misses = 0
        self._calm = 0
        # the smallest lead of each recent tick, plus the shift when it was seen: minus the shift now, it is
        # what that frame would lead the tick by now
        self._leads: deque[float] = deque(maxlen=window)

    @property
    def margin_s(self) -> float:
        """What a frame must still lead by after a move: the recent leads' spread, at least the minimum."""
        spread = max(self._leads) - min(self._leads) if self._leads else 0.0
        return max(self.floor_s, spread)

    def missed(self) -> None:
        """A caller's frame came after the tick it was meant for (a session with none in reserve found its
        inbox empty) while the ticks ran early: the ticks move back by the margin, and the margin doubles
        (up to MAX_MARGIN_S), halving again after CALM_TICKS ticks with no frame missed. Moving a tick later
        never makes a frame miss it."""
        self._calm = 0
        if self.shift_s <= 0:
            return
        self.misses += 1
        back = min(self.shift_s, self.margin_s)
        self.shift_s -= back
        self.floor_s = min(MAX_MARGIN_S, 2 * self.floor_s)
        self._leads.clear()  # measured against ticks that have moved: measure again

    def observe(self, leads_s: np.ndarray) -> float:
        """One tick's frames arrived `leads_s` seconds before it started (a frame held longer leads by its
        time modulo the tick). Returns how much earlier the next tick starts (0 when it stays put)."""
        leads = np.mod(leads_s[np.isfinite(leads_s)], self.tick_s)
        if not leads.size:
            return 0.0
        self._calm += 1
        if self._calm >= CALM_TICKS and self.floor_s > self.min_margin_s:
            self.floor_s, self._calm = max(self.min_margin_s, self.floor_s / 2), 0
        self._leads.append(float(leads.min()) + self.shift_s)
        if len(self._leads) < (self._leads.maxlen or 0):
            return 0.0
        spare = min(self._leads) - self.shift_s - self.margin_s
        if spare <= 0:
            return 0.0
        move = min(self.step_s, spare)
        self.shift_s += move
        return move
