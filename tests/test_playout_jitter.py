"""The playout's start delay follows the measured jitter (agent/audio_out/playout_timing.py, `ArrivalJitter`):
it grows at once after a turn whose frames came late, shrinks back after steady ones, never drops below what
the lateness in its window needs, and covers a lone burst of late frames only briefly, recurring ones while
they recur. On a manual clock, then through the buffer itself in real time, where a
fixed one-frame delay (the playout before it adapted) gaps on the second of two late turns and starts every
turn a frame late on a steady machine."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from agent.audio_out.playout_buffer import PlayoutBuffer
from agent.audio_out.playout_timing import (
    JITTER_MARGIN_S,
    JITTER_WARMUP,
    JITTER_WINDOW_S,
    MAX_START_DELAY_FRAMES,
    MIN_START_DELAY_S,
    PEAK_HOLD_S,
    ArrivalJitter,
)

pytestmark = pytest.mark.serial  # frames through the playout buffer in real time (tests/conftest.py)

FRAME_S = 0.08
RATE = 8000
FRAME = int(RATE * FRAME_S)


def turn(jitter: ArrivalJitter, t0: float, n: int, late: dict[int, float] | None = None) -> float:
    """A turn of `n` frames from `t0` on the cadence, frame k `late[k]` seconds behind it; returns its end."""
    late = late or {}
    jitter.begin_turn()
    for k in range(n):
        jitter.observe(t0 + k * FRAME_S + late.get(k, 0.0))
    return t0 + n * FRAME_S


def test_the_delay_is_one_frame_until_the_jitter_has_been_measured():
    j = ArrivalJitter(FRAME_S, FRAME_S)
    turn(j, 0.0, JITTER_WARMUP - 1)
    assert j.delay(2.0) == FRAME_S
    turn(j, 3.0, 1)
    assert j.delay(3.1) == pytest.approx(max(MIN_START_DELAY_S, JITTER_MARGIN_S))


def steady_turns(j: ArrivalJitter, t: float, turns: int, seed: int) -> float:
    """`turns` turns of 20 frames a second apart, each frame up to 4 ms behind its cadence."""
    rng = np.random.default_rng(seed)
    for _ in range(turns):
        t = turn(j, t + 1.0, 20, {k: float(rng.uniform(0, 0.004)) for k in range(20)})
    return t


def test_steady_frames_shrink_the_delay_and_a_late_one_raises_it_at_once_for_its_hold():
    j = ArrivalJitter(FRAME_S, FRAME_S)
    t = steady_turns(j, turn(j, 0.0, JITTER_WARMUP), 5, 3)
    steady = j.delay(t)
    assert steady <= 0.004 + JITTER_MARGIN_S + 1e-9 < FRAME_S  # a fixed one-frame delay stays at 80 ms
    start = t + 1.0
    t = turn(j, start, 20, {7: 0.12, 8: 0.12, 9: 0.05})  # one tick 120 ms late
    assert j.delay(t) == pytest.approx(0.12 + JITTER_MARGIN_S)  # above a frame: a fixed delay would gap
    last_peak = start + 9 * FRAME_S + 0.05  # the late frames' last arrival
    assert j.delay(last_peak + PEAK_HOLD_S - 0.05) == pytest.approx(0.12 + JITTER_MARGIN_S)  # held
    # a lone peak is not paid for in every turn of the window: past its hold, the steady frames' delay
    after = last_peak + PEAK_HOLD_S + 0.05
    assert j.delay(after) <= steady + 1e-9
    t = steady_turns(j, max(t, after), 2, 4)
    t = turn(j, t + JITTER_WINDOW_S, 20)  # steady again, the late frames out of the window
    assert j.delay(t) == pytest.approx(max(MIN_START_DELAY_S, JITTER_MARGIN_S))


def test_peaks_that_recur_are_covered_between_them_for_the_window():
    """A frame 100 ms late every 3 s (a periodic stall): once two have come, the delay covers the third before
    it comes, and keeps covering them while they recur; when they stop, it comes down within twice their
    period."""
    j = ArrivalJitter(FRAME_S, FRAME_S)
    t = turn(j, 0.0, JITTER_WARMUP)
    start, peaks = t + 1.0, []
    j.begin_turn()
    for k in range(150):  # one long turn: 12 s
        late = 0.1 if k % 37 == 20 else 0.0  # every 2.96 s
        j.observe(start + k * FRAME_S + late)
        if late:
            peaks.append(start + k * FRAME_S + late)
    period = peaks[1] - peaks[0]
    assert period > PEAK_HOLD_S
    # between the second and the third peak, past a lone peak's hold: still covered
    lone = ArrivalJitter(FRAME_S, FRAME_S)
    turn(lone, 0.0, JITTER_WARMUP)
    turn(lone, start, 60, {20: 0.1})
    assert lone.delay(peaks[0] + period - 0.1) < 0.1  # one peak alone: forgotten after its hold
    end = start + 150 * FRAME_S
    assert j.delay(end) == pytest.approx(0.1 + JITTER_MARGIN_S)  # the fourth peak is 1 s away: covered
    # when the next would have come: still covered; no peak for twice their period: down again
    assert j.delay(peaks[-1] + period + 0.1) == pytest.approx(0.1 + JITTER_MARGIN_S)
    assert j.delay(peaks[-1] + 2 * period + 0.1) < 0.1


def test_a_burst_of_late_frames_costs_the_delay_only_while_it_lasts_and_briefly_after():
    """Another call starting beside this one: for 2 s frames come in pairs, 80-160 ms late; then steady. The
    turn's frames played after it wait the steady jitter, not the burst's lateness for the next 8 s."""
    j = ArrivalJitter(FRAME_S, FRAME_S)
    t = steady_turns(j, turn(j, 0.0, JITTER_WARMUP), 3, 5)
    steady = j.delay(t)
    start = t + 1.0
    late = {k: 0.08 * (k % 2) + 0.08 for k in range(10, 35)}  # pairs: one late by 160 ms, the next by 80
    j.begin_turn()
    for k in range(120):
        j.observe(start + k * FRAME_S + late.get(k, 0.0))
    last = start + 34 * FRAME_S + late[34]
    assert j.delay(last) == pytest.approx(0.16 + JITTER_MARGIN_S)  # during the burst: all of it
    # the burst's peaks came every frame or two: held a lone peak's hold after the last
    assert j.delay(last + PEAK_HOLD_S + 0.05) <= steady + 1e-9
    assert j.delay(start + 120 * FRAME_S) <= steady + 1e-9


def test_the_delay_never_drops_below_the_windows_lateness_and_is_capped():
    j = ArrivalJitter(FRAME_S, FRAME_S)
    rng = np.random.default_rng(5)
    t = 0.0
    for _ in range(40):
        late = {k: float(rng.exponential(0.02)) for k in range(15)}
        t = turn(j, t + 0.5, 15, late)
        assert j.delay(t) >= min(j.lateness(t), MAX_START_DELAY_FRAMES * FRAME_S) + MIN_START_DELAY_S - 1e-9
    turn(j, t + 0.5, 3, {1: 1.0})  # a stall of a second: the delay is capped, that turn gaps
    assert j.delay(t + 2.0) == MAX_START_DELAY_FRAMES * FRAME_S


def test_a_burst_at_a_turns_start_is_not_lateness():
    """Frames that queued upstream arrive together, then on the cadence: the first plays first and the rest
    are already there, so nothing needs a delay."""
    j = ArrivalJitter(FRAME_S, FRAME_S, warmup=0)
    j.begin_turn()
    for _ in range(4):
        assert j.observe(10.0) == 0.0  # four at once
    for k in range(4, 12):
        assert j.observe(10.0 + (k - 3) * FRAME_S) == 0.0


class Recorder:
    """A sink that records when each chunk was handed over and when it was to start."""

    sample_rate = RATE

    def __init__(self) -> None:
        self.writes: list[tuple[float, float]] = []

    async def write(self, samples: np.ndarray, at: float) -> None:
        self.writes.append((time.monotonic(), at))

    def cut(self, at: float) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def play_turn(buf: PlayoutBuffer, n: int, late: dict[int, float]) -> float:
    """Write a turn of `n` frames on the cadence, frame k `late[k]` behind it; returns its first arrival."""
    buf.begin_segment()
    t0 = time.monotonic()
    for k in range(n):
        due = t0 + k * FRAME_S + late.get(k, 0.0)
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        await buf.write(np.full(FRAME, 1000, np.int16))
    buf.end_segment()
    await buf.play_out(timeout=2.0)
    return t0


def run_turns(turns: list[tuple[int, dict[int, float]]], adapt: bool) -> tuple[PlayoutBuffer, list[float]]:
    async def main():
        buf = PlayoutBuffer(Recorder(), FRAME_S)
        if not adapt:  # the playout before it adapted: one frame, always
            buf.jitter.warmup = 10**9
        buf.start()
        firsts = []
        for n, late in turns:
            before = len(buf.sink.writes)
            t0 = await play_turn(buf, n, late)
            firsts.append(buf.sink.writes[before][1] - t0)  # from the first frame's arrival to its start
        await buf.aclose()
        return buf, firsts

    return asyncio.run(main())


@pytest.mark.parametrize("adapt", [True, False], ids=["adapting", "fixed one frame"])
def test_a_turn_after_a_late_one_plays_without_a_gap(adapt):
    """Two turns whose fourth frame is 130 ms late: the first gaps (nothing was measured yet), the second
    starts late enough not to. With a fixed delay of one frame both gap."""
    late = {3: 0.13, 4: 0.13}
    buf, _ = run_turns([(JITTER_WARMUP, late), (8, late)], adapt)
    gaps = buf.stats["gaps"]
    print(buf.stats)
    if adapt:
        assert gaps == 1  # the first turn's
    else:
        assert gaps == 2


@pytest.mark.parametrize("adapt", [True, False], ids=["adapting", "fixed one frame"])
def test_on_a_steady_machine_a_turn_starts_promptly(adapt):
    buf, firsts = run_turns([(JITTER_WARMUP, {}), (6, {})], adapt)
    print(firsts, buf.stats)
    assert buf.stats["gaps"] == 0
    if adapt:
        assert firsts[1] < 0.04  # the measured jitter (scheduling of this loop) and the margin
    else:
        assert firsts[1] == pytest.approx(FRAME_S, abs=0.005)


@pytest.mark.parametrize("adapt", [True, False], ids=["adapting", "fixed one frame"])
def test_a_long_first_turn_plays_sooner_once_the_jitter_is_measured(adapt):
    """A call's first turn starts a frame late (nothing measured yet). Once the steady frames have been
    measured, the audio that waits beyond what the jitter needs is cut from the chunks' quietest stretches, a
    little at a time, so the rest of the turn plays sooner, without a gap; with a fixed delay every frame
    waits its whole frame to the end of the turn."""

    async def main():
        buf = PlayoutBuffer(Recorder(), FRAME_S)
        if not adapt:
            buf.jitter.warmup = 10**9
        buf.start()
        buf.begin_segment()
        t0 = time.monotonic()
        arrivals = []
        for k in range(JITTER_WARMUP + 30):
            await asyncio.sleep(max(0.0, t0 + k * FRAME_S - time.monotonic()))
            arrivals.append(time.monotonic())
            await buf.write((np.sin(np.arange(FRAME) * 0.3) * 8000).astype(np.int16))
        buf.end_segment()
        await buf.play_out(timeout=2.0)
        await buf.aclose()
        waits = [at - arrived for (_, at), arrived in zip(buf.sink.writes, arrivals, strict=True)]
        lateness = [arrived - (t0 + k * FRAME_S) for k, arrived in enumerate(arrivals)]
        return buf, waits, lateness

    buf, waits, lateness = asyncio.run(main())
    print([round(w * 1000) for w in waits], [round(x * 1000) for x in lateness], buf.stats)
    # (bounds one way: a loaded machine only makes this loop late, never early)
    if max(lateness) < JITTER_MARGIN_S:  # frames on their cadence within the margin the playout keeps: no gap
        assert buf.stats["gaps"] == 0
    else:  # a machine so busy this loop fell behind its cadence: a gap no longer than the frame was late
        assert buf.stats["gap_s"] <= max(lateness)
    assert waits[0] >= FRAME_S - 0.005
    if adapt:
        assert max(waits[-8:]) < 0.055 and 0.02 < buf.stats["trimmed_s"] < FRAME_S
    else:
        assert min(waits[-8:]) >= FRAME_S - 0.005 and buf.stats["trimmed_s"] == 0


def test_after_a_gap_the_turn_waits_the_measured_jitter_so_the_next_late_frame_does_not_gap():
    """A long turn, its cushion trimmed to the jitter measured on a steady machine; then a frame 100 ms late
    (a gap: nothing measured had said so) and, ten frames later, another as late. After the first gap the turn
    resumes with the start delay the late frame raised (its lateness and the margin), so the second plays
    without one (resumed with no cushion but the frame queued behind the late one, it gapped again). The
    second is no later than the first: what the test's own loop adds on a busy machine then has the margin
    and the sink's handover slack to fall in."""
    late = {JITTER_WARMUP + 12: 0.10, JITTER_WARMUP + 22: 0.10}
    buf, _ = run_turns([(JITTER_WARMUP + 30, late)], adapt=True)
    print(buf.stats)
    assert buf.stats["trimmed_s"] > 0.03  # the cushion had been trimmed before the late frames came
    assert buf.stats["gaps"] == 1, buf.stats


def test_lateness_is_against_the_earliest_cadence_of_the_turn():
    """The engine's tick moving toward the callers' frames makes a turn's frames come a little earlier each
    tick; a frame that then comes on the first frame's cadence is late by that much, not on time."""
    j = ArrivalJitter(FRAME_S, FRAME_S, warmup=0)
    j.begin_turn()
    for k in range(10):
        j.observe(10.0 + k * FRAME_S - 0.005 * k)  # 5 ms earlier each frame: 45 ms earlier by the tenth
    assert j.observe(10.0 + 10 * FRAME_S) == pytest.approx(0.045, abs=1e-9)
