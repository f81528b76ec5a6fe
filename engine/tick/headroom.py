"""Admission by headroom: whether the tick can take another caller, judged from the live step's recent times
and the deadlines missed, with hysteresis.

Read from any thread (the worker's admission, the snapshot); fed by the tick thread through `Accounting`.
Knows times and counts; knows nothing of the model or of sessions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.api import EngineOverloaded
from engine.observe.metrics import Accounting

OVERLOAD_WINDOW = 100  # ticks (8 s) of history behind the headroom decision
OVERLOAD_MIN_TICKS = 10  # no decision before this many ticks were measured
OVERLOAD_MISSES = 5  # missed deadlines in the window that mean overload


class Headroom:
    """The live step's p95 over the last OVERLOAD_WINDOW ticks against the tick, and the deadlines missed.
    Overloaded above `overload_ratio` of the tick (or at OVERLOAD_MISSES misses); not overloaded again until
    below `recover_ratio` with misses (nearly) stopped. The p95 rather than the max-like p99 of 100 ticks: one
    collector pause must not turn callers away; sustained lateness shows in the missed deadlines."""

    def __init__(
        self,
        acct: Accounting,
        tick_ms: float,
        overload_ratio: float,
        recover_ratio: float,
        slips: Callable[[], int] = lambda: 0,
    ) -> None:
        """`slips`: how many of the recent ticks found a session past a bound (a prompt not live, a result
        not prefilled, in time): the slack no longer holds the bounds, and no session is taken on."""
        self.acct, self.tick_ms, self.slips = acct, tick_ms, slips
        self.overload_ratio, self.recover_ratio = overload_ratio, recover_ratio
        self._overloaded = False
        self.refused = 0  # sessions refused for lack of headroom

    def recent_p95(self) -> float:
        recent = list(self.acct.live_ms)[-OVERLOAD_WINDOW:]
        return float(np.percentile(recent, 95)) if recent else 0.0

    @property
    def overloaded(self) -> bool:
        if len(self.acct.live_ms) < OVERLOAD_MIN_TICKS:
            return self._overloaded
        p95, missed = self.recent_p95(), sum(self.acct.recent_missed) + self.slips()
        if self._overloaded:
            self._overloaded = p95 > self.recover_ratio * self.tick_ms or missed > OVERLOAD_MISSES // 2
        else:
            self._overloaded = p95 > self.overload_ratio * self.tick_ms or missed >= OVERLOAD_MISSES
        return self._overloaded

    def refuse(self, message: str) -> EngineOverloaded:
        """A refusal, counted: the error to raise."""
        self.refused += 1
        return EngineOverloaded(message)

    def check(self) -> None:
        """EngineOverloaded while overloaded."""
        if self.overloaded:
            raise self.refuse(
                f"no headroom: the live step's recent p95 is {self.recent_p95():.0f} ms of the "
                f"{self.tick_ms:g} ms tick, {sum(self.acct.recent_missed)} of the last "
                f"{len(self.acct.recent_missed)} ticks late, {self.slips()} past a session's bound; "
                "route the caller to another worker or retry later"
            )
