"""Echo mode (engine/tick/echo.py), a measurement tool: the engine at the tiny preset, ticks driven by hand.
With echo on a live session's output frame is its own input frame of that tick, resampled to the output clock,
inside one turn that never ends and with no tool call; marked frames' timings reach the snapshot. With echo
off the same pushes give the model's own output, and nothing of echo mode is there."""

import numpy as np
import pytest

from engine.api import AudioFrame, ToolCallStarted, TurnEnded
from engine.tick.echo import MARK, Echo
from engine.tick.engine import Engine, EngineConfig
from engine.tick.slots import FrameInbox
from engine_support import ManualClock, drain, run_ticks
from testkit.concierge import PROMPT, TOOLS

N_IN, N_OUT = 1280, 1764


def engine_on(echo: bool) -> Engine:
    return Engine(EngineConfig(preset="tiny", num_slots=2, start=False, echo=echo), clock=ManualClock(100.0))


def until_live(engine: Engine, handle, k: int = 0) -> int:
    """Ticks (caller audio silent meanwhile) until the session is live with nothing held; returns
    the next tick."""
    while handle.phase != "live":
        handle.push_audio(np.zeros(N_IN, np.float32))
        k = run_ticks(engine, k, 1)
    while handle.backlog_frames:  # the frame kept as jitter buffer on resuming
        k = run_ticks(engine, k, 1)
    drain(handle)
    return k


def burst(seed: int) -> np.ndarray:
    """A frame of quiet tone with a loud 2 ms click at a seed-dependent place."""
    rng = np.random.default_rng(seed)
    t = np.arange(N_IN) / 16_000
    x = 0.05 * np.sin(2 * np.pi * (300 + 50 * seed) * t) + 0.01 * rng.standard_normal(N_IN)
    at = 200 + 97 * seed
    x[at : at + 32] = 0.8
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def echo_engine():
    e = engine_on(echo=True)
    yield e
    e.close()


def test_a_pushed_frame_comes_back_resampled_in_the_next_ticks_output(echo_engine):
    e = echo_engine
    h = e.open_session(PROMPT, TOOLS)
    k = until_live(e, h)
    for i in range(3):
        x = burst(i)
        h.push_audio(x)
        e.clock.now += 0.01
        k = run_ticks(e, k, 1)
        items = drain(h)
        out = [it.samples for it in items if isinstance(it, AudioFrame)]
        assert len(out) == 1 and out[0].shape == (N_OUT,)
        # output sample j is input time j * 1280 / 1764: linear interpolation of the frame just pushed
        want = np.interp(np.arange(N_OUT) * N_IN / N_OUT, np.arange(N_IN), x)
        np.testing.assert_allclose(out[0], want, atol=1e-5)
        # the click sits where it was, on the output clock
        assert abs(int(np.argmax(out[0] > 0.5)) - (200 + 97 * i) * N_OUT / N_IN) <= 1
        assert not any(isinstance(it, (TurnEnded, ToolCallStarted)) for it in items)
    # the whole call is one turn of the model: the gate passes every frame
    assert h.speaking
    h.close()


def test_marked_frames_are_timed_in_the_snapshot(echo_engine):
    e = echo_engine
    h = e.open_session(PROMPT, TOOLS, label="room-echo")
    k = until_live(e, h, 100)
    before = e.snapshot().echo["marked"]
    pushed = e.clock()
    h.push_audio(burst(1))
    e.clock.now += 0.03
    run_ticks(e, k, 1)
    h.push_audio(np.zeros(N_IN, np.float32))  # unmarked: not logged
    run_ticks(e, k + 1, 1)
    echo = e.snapshot().echo
    assert echo["mark"] == MARK and echo["marked"] == before + 1
    r = echo["frames"][-1]
    assert r["label"] == "room-echo" and r["tick"] == k and r["onset"] == 200 + 97
    assert r["pushed"] == pytest.approx(pushed) and r["tick_start"] == pytest.approx(pushed + 0.03)
    assert r["sent"] >= r["tick_start"] and r["backlog"] == 0
    h.close()


def test_echo_off_is_the_models_own_output_and_no_echo_state():
    e = engine_on(echo=False)
    try:
        h = e.open_session(PROMPT, TOOLS)
        k = until_live(e, h)
        x = burst(0)
        h.push_audio(x)
        run_ticks(e, k, 1)
        out = [it.samples for it in drain(h) if isinstance(it, AudioFrame)]
        want = np.interp(np.arange(N_OUT) * N_IN / N_OUT, np.arange(N_IN), x)
        assert len(out) == 1 and not np.allclose(out[0], want, atol=1e-3)
        assert e.echo is None and e.snapshot().echo is None
    finally:
        e.close()


def test_the_inbox_stamps_each_frame_with_its_arrival():
    """A frame arrives when the push that completes it comes (on the engine's clock), or, for frames a room
    wrote to shared memory, when the room wrote each (`at`); `popped_at` is the popped frame's arrival."""
    times = iter([1.0, 2.0])
    inbox = FrameInbox(N_IN, 8, clock=lambda: next(times))
    inbox.push(np.full(N_IN + 100, 0.1, np.float32))
    inbox.push(np.full(N_IN * 2, 0.2, np.float32))
    got = []
    while inbox.pop() is not None:
        got.append(inbox.popped_at)
    assert got == [1.0, 2.0, 2.0] and inbox.popped_at is None
    ring = FrameInbox(N_IN, 8, clock=lambda: 99.0)
    ring.push(np.zeros(N_IN * 2, np.int16), at=np.array([5.0, 5.08]))
    assert ring.pop() is not None and (ring.popped_at, ring.held) == (5.0, 1)
    assert ring.pop() is not None and (ring.popped_at, ring.held) == (5.08, 0)


def test_the_resampler_keeps_a_ramp_a_ramp(echo_engine):
    echo = Echo(echo_engine.model_cfg.clock, echo_engine.tokens)
    ramp = np.arange(N_IN, dtype=np.float32)[None] / N_IN
    out = echo.resample(ramp)[0]
    np.testing.assert_allclose(out, np.minimum(np.arange(N_OUT) * N_IN / N_OUT, N_IN - 1) / N_IN, atol=1e-6)
