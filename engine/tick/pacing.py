"""When the tick thread runs each tick: one every tick on the engine's clock, each starting early once the
frames it takes are all in.

Runs on the tick thread (`Engine.start`) until the engine's stop event is set. A tick is due a whole number of
ticks after an anchor, less the shift the tick's phase keeps (engine/tick/phase.py); within the margin before
it, it starts as soon as every session the last tick heard has its next caller frame in, looked for every
POLL_S. A loop more than a whole tick behind re-anchors instead of bursting, and full collections take the
slack after each tick. Knows the clock, the phase and the sessions' inboxes; knows nothing of the model or of
what a tick does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.observe.metrics import Accounting
from engine.process.collector import Collector
from engine.tick.phase import TickPhase
from engine.tick.session import HEARD_PHASES, Session

POLL_S = 0.001  # within its margin, a tick looks this often whether its frames are all in


def run_ticks(
    run_tick: Callable[[int, float, float], None],
    frames_in: Callable[[], bool],
    stop: threading.Event,
    clock: Callable[[], float],
    tick_s: float,
    phase: TickPhase,
    early: bool,
    acct: Accounting,
    collector: Collector,
) -> None:
    """Tick until `stop` is set: `run_tick(k, deadline, due)` for tick k, due `k * tick_s` after the anchor
    less the phase's shift; with `early`, a tick starts within its margin once `frames_in()`."""
    t0 = clock()
    k = 0
    while not stop.is_set():
        due = t0 + k * tick_s - phase.shift_s
        now = clock()
        if now < due:
            # within the margin the tick keeps for late frames, it starts as soon as every frame is in
            opens = due - phase.margin_s if early else due
            if now < opens or not frames_in():
                stop.wait(opens - now if now < opens else min(POLL_S, due - now))
                continue
            acct.record_early(due - now)
        elif now - due > tick_s:  # more than a whole tick behind: re-anchor instead of bursting
            acct.record_slip(int((now - due) / tick_s))
            t0 = now - k * tick_s + phase.shift_s
            due = now
        run_tick(k, due + tick_s, due)
        k += 1
        collector.maybe_collect(t0 + k * tick_s)


def frames_in(sessions: list[Session]) -> bool:
    """Whether every one of `sessions` (those the last tick heard) has its next caller frame in already (and
    there is one). Polled every POLL_S within the margin before a tick; stops at the first session still
    waiting."""
    heard = False
    for s in sessions:
        if s.closed or s.phase not in HEARD_PHASES:
            continue
        if not s.inbox.fresh():
            return False
        heard = True
    return heard
