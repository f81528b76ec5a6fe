"""The engine when the live step fills the tick: admission and catch-up within their bounds, counted skipping
of held audio that cannot be caught up, refusal of new sessions, and every live session keeping its cadence.

The tick is filled without waiting for it: the engine's clock is the real one plus an offset, and a hook on
the live step adds a whole tick to the offset, so every tick ends past its deadline and no slack is ever left.
Ticks are driven by hand; bounds are asserted in ticks, never in wall-clock time. Tool calls are produced by
teacher forcing the function channel with real tokens (dummy weights decide nothing).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.api import (
    AudioFrame,
    EngineClosed,
    EngineFull,
    EngineOverloaded,
    FunctionCall,
    ToolResultConsumed,
)
from engine.tick.engine import Engine, EngineConfig
from engine.tick.slots import FrameInbox
from engine_support import drain
from prompts import load_prompt
from tools.schemas import tool_specs

TICK_S = 0.08
FRAME = 1280
BOUND = 25  # ticks: 2 s, the default admission and replay bounds
CALL = [{"name": "hotel_info", "arguments": {"topic": "parking"}}]


class OffsetClock:
    """Real time plus whatever the slow hook added: work still costs what it costs, and the
    tick looks full."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def slow_down(engine: Engine, clock: OffsetClock, extra_s: float) -> None:
    """Make every live step appear to take `extra_s` longer than it does."""
    live = engine.runner.live

    def slowed(plan):
        out = live(plan)
        clock.offset += extra_s
        return out

    engine.runner.live = slowed


def quiet_machine(engine: Engine, clock: OffsetClock, live_s: float = 0.005) -> None:
    """Make every live step appear to take `live_s`, whatever it costs on this machine (the suite shares the
    machine: a busy neighbour must not look like an engine that cannot keep up)."""
    live = type(engine.runner).live.__get__(engine.runner)

    def quiet(plan):
        t = clock()
        out = live(plan)
        clock.offset += live_s - (clock() - t)
        return out

    engine.runner.live = quiet


def tick(engine: Engine, clock: OffsetClock, k: int) -> None:
    start = clock()
    engine.run_tick(k, start + TICK_S)


def speech(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(n * FRAME)).astype(np.float32)


def concierge() -> tuple[str, list[dict]]:
    return load_prompt("concierge", hotel_name="The Harbour Hotel", today="Monday, November 30"), tool_specs()


def test_frame_inbox_skips_silence_first_then_the_oldest_and_counts_it():
    inbox = FrameInbox(4, max_frames=100)
    loud, quiet = np.full(4, 0.5, np.float32), np.zeros(4, np.float32)
    pattern = [loud, quiet, loud, quiet, quiet, loud, loud, quiet]  # 8 frames: 4 silent
    inbox.push(np.concatenate(pattern))
    assert inbox.skip(3, silent_only=True) == 3  # the three oldest silent frames
    assert inbox.skipped == 3 and len(inbox) == 5
    assert inbox.skip(10) == 3  # never the newest two: the last silent one, then the oldest loud ones
    kept = [inbox.pop() for _ in range(len(inbox))]
    assert [float(f[0]) for f in kept] == [0.5, 0.0]  # the newest two frames, in order
    assert inbox.skipped == 6 and inbox.frames_in == 8 and inbox.dropped == 0


def test_a_full_tick_still_admits_64_sessions_within_the_bound_and_keeps_their_cadence():
    """64 sessions open at once with the 3,399-token concierge prompt and the hotel's five tools while every
    live step takes longer than the tick. Each is live within 25 ticks of opening; from then on it delivers a
    frame every tick; every frame its caller sent is consumed or counted as skipped."""
    clock = OffsetClock()
    with Engine(EngineConfig(preset="tiny", num_slots=64, start=False), clock=clock) as e:
        slow_down(e, clock, TICK_S)
        prompt, tools = concierge()
        assert len(e.tokens.prompt_ids(prompt, tools)) > 3000
        handles = [e.open_session(prompt, tools) for _ in range(64)]
        live_at: dict[int, int] = {}
        ticks_out: dict[int, list[int]] = {i: [] for i in range(64)}
        for k in range(BOUND + 10):
            for i, h in enumerate(handles):
                h.push_audio(speech(1, 1000 * k + i))  # a caller in real time: one frame per tick
            tick(e, clock, k)
            for i, h in enumerate(handles):
                got = [o.tick for o in drain(h) if isinstance(o, AudioFrame)]
                ticks_out[i] += got
                if h.phase == "live":
                    live_at.setdefault(i, k)
        snap = e.snapshot()
        print(
            "live at tick",
            sorted(set(live_at.values())),
            "missed",
            snap.missed_deadlines,
            "skipped",
            snap.skipped_frames,
            "overruns",
            snap.overruns,
        )
        assert sorted(live_at) == list(range(64))
        assert max(live_at.values()) <= BOUND
        for i in range(64):  # a frame every tick once live, none before
            assert ticks_out[i] == list(range(ticks_out[i][0], BOUND + 10)), i
        for s in snap.sessions:
            assert s.frames_in == s.frames_consumed + s.skipped_frames + s.backlog_frames, s
            assert s.dropped_frames == 0
        assert snap.missed_deadlines == BOUND + 10  # every tick was late, and counted
        assert snap.overloaded
        with pytest.raises(EngineOverloaded, match="no headroom"):
            e.open_session(prompt, tools)
        assert e.load == 1.0 and e.occupancy == 1.0


def test_catch_up_after_a_long_tool_wait_is_bounded_and_skips_silence_first():
    """A session waits 100 ticks for its tool while its caller keeps sending audio (mostly silence), all with
    no slack in any tick. It is live again within the replay bound of its results being prefilled; the held
    audio it could not replay in time was skipped and counted, silence first; its neighbour never missed a
    frame."""
    clock = OffsetClock()
    with Engine(EngineConfig(preset="tiny", num_slots=4, start=False), clock=clock) as e:
        slow_down(e, clock, TICK_S)
        prompt = "You are the concierge of a small hotel."
        tools = [t for t in tool_specs() if t["name"] == "hotel_info"]
        h, neighbour = e.open_session(prompt, tools), e.open_session(prompt, tools)
        k = 0
        loud_sent = 0
        consumed_at = None
        calls: list[FunctionCall] = []
        n_ticks = 4 + 40 + 100 + BOUND + 20
        for k in range(n_ticks):
            loud = k % 5 == 0
            loud_sent += loud
            h.push_audio(speech(1, k) if loud else np.zeros(FRAME, np.float32))
            if neighbour.phase == "live":  # its caller talks from when it is live (admission is tested apart)
                neighbour.push_audio(speech(1, 7 + k))
            if k == 4:
                h.force_function(e.tokens.call_ids(CALL))
            tick(e, clock, k)
            items = drain(h)
            calls += [i for i in items if isinstance(i, FunctionCall)]
            if calls and k == calls[0].tick + 100:
                h.submit_tool_result(calls[0].call_id, "Parking is in the garage on Quay Street.")
            if any(isinstance(i, ToolResultConsumed) for i in items):
                consumed_at = k
        assert calls and calls[0].name == "hotel_info"
        assert consumed_at is not None and h.phase == "live"
        snap = {s.id: s for s in e.snapshot().sessions}
        mine = snap[h.id]
        print("call at", calls[0].tick, "live again at", consumed_at, "skipped", mine.skipped_frames)
        assert (
            consumed_at - (calls[0].tick + 100) <= BOUND + 4
        )  # results prefilled in a few ticks, then replay
        assert 0 < mine.skipped_frames <= (n_ticks - loud_sent)  # only silence had to go
        assert mine.frames_in == mine.frames_consumed + mine.skipped_frames + mine.backlog_frames
        ticks = [o.tick for o in drain(neighbour) if isinstance(o, AudioFrame)]
        assert ticks == list(range(ticks[0], n_ticks))  # the last drain took the rest; cadence never broke
        assert snap[neighbour.id].skipped_frames == 0


def test_overload_refuses_new_sessions_and_recovers_when_the_headroom_returns():
    clock = OffsetClock()
    with Engine(EngineConfig(preset="tiny", num_slots=4, start=False), clock=clock) as e:
        h = e.open_session("You are the concierge.", [])
        for k in range(12):
            tick(e, clock, k)
        assert not e.overloaded and e.load == 0.25
        slow_down(e, clock, TICK_S)
        for k in range(12, 24):
            tick(e, clock, k)
        assert e.overloaded and e.load == 1.0
        with pytest.raises(EngineOverloaded) as refused:
            e.open_session("You are the concierge.", [])
        assert isinstance(refused.value, EngineFull)  # callers that route on EngineFull route this too
        assert e.snapshot().refused_sessions == 1 and e.occupancy == 0.25
        quiet_machine(e, clock)  # the machine is quiet again
        for k in range(24, 24 + 100):
            tick(e, clock, k)
        assert not e.overloaded  # a window of ticks with headroom and no miss
        e.open_session("You are the concierge.", []).close()
        h.close()


def test_a_worker_that_prefers_a_slow_answer_to_none_admits_while_overloaded():
    """`refuse_when_overloaded=False`: overload is measured and shown, but the worker reports its slots in use
    (not full) and a new session takes a free slot."""
    clock = OffsetClock()
    cfg = EngineConfig(preset="tiny", num_slots=4, start=False, refuse_when_overloaded=False)
    with Engine(cfg, clock=clock) as e:
        h = e.open_session("You are the concierge.", [])
        slow_down(e, clock, TICK_S)
        for k in range(12):
            tick(e, clock, k)
        assert e.overloaded and e.snapshot().overloaded
        assert e.load == e.occupancy == 0.25
        assert e.open_session("You are the concierge.", []).phase in ("prompt", "replay", "live")
        assert e.snapshot().refused_sessions == 0 and e.occupancy == 0.5
        h.close()


def test_a_call_nested_past_the_parsers_depth_is_that_sessions_bad_call_not_the_ticks():
    """A 1,200-deep call (a legal length with max_call_tokens raised) used to raise RecursionError out of the
    parser and stop the tick thread; now the session gets an error result and everyone keeps the cadence."""
    clock = OffsetClock()
    with Engine(
        EngineConfig(preset="tiny", num_slots=2, start=False, max_call_tokens=8192), clock=clock
    ) as e:
        h, other = e.open_session("You are the concierge.", []), e.open_session("You are the concierge.", [])
        tok = e.tokens
        deep = "<TOOLCALL>" + "[" * 1200 + "]" * 1200 + "</TOOLCALL>"
        h.force_function([tok.call_start, *tok.encode(deep), tok.call_end])
        for k in range(40):
            other.push_audio(speech(1, k))
            e.run_tick(k, clock() + 60.0)  # all paused work completes within each tick
        items = drain(h)
        assert any(type(i).__name__ == "ToolCallRejected" and "cannot be read" in i.reason for i in items)
        assert h.phase == "live" and e.failure is None
        ticks = [o.tick for o in drain(other) if isinstance(o, AudioFrame)]
        assert ticks == list(range(ticks[0], 40))


def test_when_the_tick_thread_dies_every_session_is_told_and_the_worker_reports_full():
    with Engine(EngineConfig(preset="tiny", num_slots=2)) as e:
        h = e.open_session("You are the concierge.", [])

        def broken(plan):
            raise RuntimeError("device lost")

        e.runner.live = broken
        got = h.outputs.get(timeout=60)  # an event, not a clock: the next tick fails
        while type(got).__name__ != "SessionFailed":
            got = h.outputs.get(timeout=60)
        assert "device lost" in got.message
        assert e.load == 1.0
        with pytest.raises(EngineClosed, match="tick thread stopped"):
            e.open_session("You are the concierge.", [])
