"""The tick's phase against the callers' frames (engine/tick/phase.py): ticks move earlier while every frame
arrives well before its tick, never so far that a frame misses it, and not at all when some room's frames
arrive just in time. Simulated on exact numbers (arrival times against tick times), then through a real
engine on a manual clock."""

from __future__ import annotations

import numpy as np

from engine.tick.engine import Engine, EngineConfig
from engine.tick.pacing import POLL_S
from engine.tick.phase import MIN_MARGIN_S, TickPhase
from engine_support import ManualClock
from testkit.concierge import PROMPT, TOOLS

TICK = 0.08


def run(phase: TickPhase, arrivals: list[np.ndarray]) -> list[np.ndarray]:
    """Tick k starts at k * TICK - shift; `arrivals[k]`: when each room's frame for tick k arrived. The leads
    each tick saw (a frame that arrived after its tick started waits for the next: its lead is negative
    here, and the tick after sees it a tick early)."""
    seen = []
    for k, a in enumerate(arrivals):
        start = k * TICK - phase.shift_s
        leads = start - a
        seen.append(leads)
        phase.observe(leads)
    return seen


def test_one_callers_frames_draw_the_tick_to_just_after_they_arrive():
    """Frames that arrive 50 ms before the tick (2 ms of jitter): the tick moves to about the margin after
    them, 10 ms a tick at most, and no frame ever arrives after its tick. Without the move each would wait
    50."""
    rng = np.random.default_rng(1)
    arrivals = [np.array([k * TICK - 0.05 + rng.uniform(-0.002, 0.002)]) for k in range(200)]
    phase = TickPhase(TICK)
    leads = np.concatenate(run(phase, arrivals))
    assert leads.min() > 0  # never late for its tick
    settled = leads[-50:]
    assert settled.min() > MIN_MARGIN_S - 0.002 and settled.max() < 0.012, settled
    assert 0.035 < phase.shift_s < 0.047


def test_a_room_whose_frames_arrive_just_in_time_holds_the_tick_where_it_is():
    rng = np.random.default_rng(2)
    arrivals = [
        np.array([k * TICK - 0.05 + rng.uniform(-0.002, 0.002), k * TICK - 0.003]) for k in range(100)
    ]
    phase = TickPhase(TICK)
    run(phase, arrivals)
    assert phase.shift_s == 0.0


def test_jittery_arrivals_keep_a_margin_as_wide_as_their_spread():
    """Arrivals that wander over 20 ms: the tick stops 20 ms or more after the earliest lead, so even the
    latest frame still makes its tick."""
    rng = np.random.default_rng(3)
    arrivals = [np.array([k * TICK - 0.06 + rng.uniform(-0.01, 0.01)]) for k in range(400)]
    phase = TickPhase(TICK)
    leads = np.concatenate(run(phase, arrivals))
    assert leads.min() > 0 and phase.margin_s > 0.015
    assert phase.shift_s > 0.01  # it still moved: from 50-70 ms of lead to the jitter's width


def test_frames_that_drift_past_the_tick_are_caught_again():
    """A caller's clock slower than the server's (50 ppm, 0.004 ms a tick): its frames arrive a little later
    every tick, until one arrives after its tick has started and waits for the next (an underrun, counted by
    the scheduler). The tick is then drawn earlier again: most of the time the frames lead by little."""
    phase = TickPhase(TICK)
    arrivals = [np.array([k * TICK - 0.02 + k * 0.000004]) for k in range(10_000)]
    leads = np.concatenate(run(phase, arrivals))
    # each time a frame comes after its tick, every later one is a tick behind (taken by the next tick)
    missed = np.count_nonzero(np.diff(np.floor(leads / TICK)))
    assert 0 < missed < 12  # a tick missed now and then (about every 100 s), as the drift crosses it
    assert np.mean(np.mod(leads[500:], TICK) < 0.015) > 0.85


def test_the_engine_moves_its_ticks_toward_a_callers_arrivals():
    """Through the engine: a caller's frame pushed 50 ms before each tick. Once the session is live its
    frames' leads draw the tick earlier (the snapshot shows by how much) and the model hears each frame in
    the tick it was pushed for."""
    engine = Engine(EngineConfig(preset="tiny", num_slots=2, start=False), clock=ManualClock(100.0))
    try:
        h = engine.open_session(PROMPT, TOOLS)
        frame = np.zeros(1280, np.float32)
        t0 = engine.clock.now
        for k in range(120):
            start = t0 + k * TICK - engine.phase.shift_s
            engine.clock.now = t0 + k * TICK - 0.05  # the caller's clock: the tick's moves do not move it
            h.push_audio(frame)
            engine.clock.now = start
            engine.run_tick(k, start + 60.0)
        assert 0.03 < engine.phase.shift_s < 0.05
        assert engine.snapshot().tick_shift_ms == round(engine.phase.shift_s * 1000, 1)
        assert engine.snapshot().sessions[0].reserve_frames == 0
    finally:
        engine.close()


def test_a_frame_that_misses_its_tick_moves_the_ticks_back_and_widens_the_margin():
    """Locked on to frames that led by 8 ms, one comes after its tick (a busy core held it up): the ticks
    move back by the margin and the margin doubles, so the next such delay is absorbed; after 30 s of calm
    the margin halves again."""
    phase = TickPhase(TICK)
    arrivals = [np.array([k * TICK - 0.05]) for k in range(100)]
    run(phase, arrivals)
    locked, margin = phase.shift_s, phase.margin_s
    assert 0.035 < locked < 0.045
    phase.missed()
    assert phase.shift_s == locked - margin and phase.floor_s == 2 * margin and phase.misses == 1
    for _ in range(400):
        phase.observe(np.array([0.02]))  # calm: every frame well ahead
    assert phase.floor_s == margin


def test_the_engine_counts_a_frame_that_came_late_but_not_a_caller_who_stopped_sending():
    engine = Engine(EngineConfig(preset="tiny", num_slots=2, start=False), clock=ManualClock(100.0))
    try:
        h = engine.open_session(PROMPT, TOOLS)
        frame = np.zeros(1280, np.float32)
        plan_live, plans = engine.scheduler.plan_live, []

        def planned(tick, reset):  # each tick's plan, which says how many of its frames came late
            plans.append(plan_live(tick, reset))
            return plans[-1]

        engine.scheduler.plan_live = planned
        for k in range(60):
            if k == 41:
                h.push_audio(np.zeros(2560, np.float32))  # tick 40's frame came after it, with tick 41's
            elif k != 40 and k < 50:  # from tick 50 the caller sends nothing
                h.push_audio(frame)
            engine.run_tick(k, engine.clock.now + 60.0)
            engine.clock.now += TICK
        late = [plan.late for plan in plans]
        assert late[41] == 1 and sum(late) == 1, late
    finally:
        engine.close()


class Sleeps:
    """The tick thread's own loop (`Engine._loop`) on a manual clock: each of its sleeps moves the clock on by
    what it asked, and the callers' frames due meanwhile are pushed at their times; it stops after `ticks`."""

    def __init__(self, engine: Engine, callers: list, ticks: int) -> None:
        self.engine, self.callers, self.ticks = engine, callers, ticks  # callers: (handle, arrival times)
        self.slept: list[float] = []

    def is_set(self) -> bool:
        return self.engine.acct.ticks >= self.ticks

    def set(self) -> None:  # (the engine's close)
        self.ticks = 0

    def wait(self, seconds: float) -> bool:
        self.slept.append(seconds)
        clock = self.engine.clock
        until = clock.now + seconds
        for handle, arrivals in self.callers:
            while arrivals and arrivals[0] <= until:
                clock.now = max(clock.now, arrivals.pop(0))
                handle.push_audio(np.zeros(1280, np.float32))
        clock.now = until
        return False


def loop_on_a_manual_clock(callers: int, sends, ticks: int = 150, **config):
    """`callers` sessions on an engine whose tick thread's loop runs on a manual clock; caller i's frame for
    tick k arrives 50 ms before the tick's first time unless `sends(i, k)` says it does not come. Returns the
    engine (closed) and each tick's plan (which has when the tick started and when each frame arrived)."""
    engine = Engine(EngineConfig(preset="tiny", num_slots=2, start=False, **config), clock=ManualClock(100.0))
    try:
        handles = [engine.open_session(PROMPT, TOOLS) for _ in range(callers)]
        t0 = engine.clock.now
        times = [[t0 + k * TICK - 0.05 for k in range(1, ticks + 2) if sends(i, k)] for i in range(callers)]
        plan_live, plans = engine.scheduler.plan_live, []

        def planned(tick, reset):
            plans.append(plan_live(tick, reset))
            return plans[-1]

        engine.scheduler.plan_live = planned
        engine._stop = Sleeps(engine, list(zip(handles, times, strict=True)), ticks)
        engine._loop()
    finally:
        engine.close()
    return engine, plans


def test_a_tick_starts_as_soon_as_its_frames_are_in_within_its_margin():
    """Steady frames: the ticks move toward them (engine/tick/phase.py) until a tick is due within its margin
    of them, and from then on each tick starts when its frame is in, found by polling every POLL_S, rather
    than a margin later: the frame waits at most POLL_S for its tick, where it waited the margin before."""
    engine, plans = loop_on_a_manual_clock(1, lambda i, k: True)
    waits = np.array([p.t_start - p.arrived[p.live][0] for p in plans[-40:]])
    assert np.all(waits >= 0) and np.all(waits <= POLL_S + 1e-9), waits
    assert engine.acct.early_ticks >= 40
    assert 0 < engine.acct.early_s / engine.acct.early_ticks <= MIN_MARGIN_S + 1e-9


def test_a_tick_waits_for_its_time_while_any_frame_is_still_to_come():
    """Two callers, one of whom stops sending at tick 60: from then on no tick starts before its time (the
    frames of the one still sending wait the margin again), and none starts before its time in the fixed-
    buffer baseline."""
    engine, plans = loop_on_a_manual_clock(2, lambda i, k: i == 0 or k < 60)
    after = [p for p in plans if p.tick >= 70]
    waits = np.array([p.t_start - p.arrived[p.live & np.isfinite(p.arrived)][0] for p in after])
    assert np.all(waits >= MIN_MARGIN_S - 1e-9), waits
    early_then = engine.acct.early_ticks
    assert early_then > 0  # (while both sent)
    engine, plans = loop_on_a_manual_clock(1, lambda i, k: True, fixed_buffers=True)
    assert engine.acct.early_ticks == 0
