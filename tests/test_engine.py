"""The engine at the tiny preset with dummy weights. Tool calls are produced by teacher forcing the function
channel with real tokens (dummy weights decide nothing); everything after that is the engine's own work."""

import asyncio
import json
import urllib.request

import numpy as np
import pytest

from engine.api import (
    AudioFrame,
    EngineFull,
    EngineOverloaded,
    EngineSnapshot,
    FunctionCall,
    SessionRejected,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
)
from engine.tick.engine import Engine, EngineConfig, SessionHandle
from engine.tick.slots import FrameInbox
from engine_support import CALL, ManualClock, caller_audio, drain, engine_on, poll_between_ticks, run_ticks
from testkit.concierge import PROMPT, TOOLS


def frames(items) -> list[np.ndarray]:
    return [i.samples for i in items if isinstance(i, AudioFrame)]


@pytest.fixture(scope="module")
def engine64():
    e = engine_on(num_slots=64)
    yield e
    e.close()


def open_all(engine: Engine, n: int) -> list:
    handles = [engine.open_session(PROMPT, TOOLS) for _ in range(n)]
    for i, h in enumerate(handles):
        h.push_audio(caller_audio(i, 2.4))
    return handles


def close_all(engine: Engine, handles, k: int) -> int:
    for h in handles:
        h.close()
    return run_ticks(engine, k, 1)


def waiting_on_a_call(engine: Engine) -> tuple[SessionHandle, int]:
    """A session opened on a fresh `engine` and forced into a call of the concierge's tool from its first
    tick: its handle and the next tick, three ticks into the call."""
    h = engine.open_session(PROMPT, TOOLS)
    k = run_ticks(engine, 0, 1)
    h.force_function(engine.tokens.call_ids(CALL))
    return h, run_ticks(engine, k, 3)


def test_one_sessions_tool_call_leaves_the_other_63_untouched(engine64):
    """64 sessions run twice from fresh slots, the second time with slot 7 calling a tool: every other
    session's audio and text are identical in both runs."""
    runs = []
    k = close_all(
        engine64, [engine64.open_session(PROMPT, TOOLS)], run_ticks(engine64, 0, 1)
    )  # cache the prompt
    for with_call in (False, True):
        handles = open_all(engine64, 64)
        if with_call:
            handles[7].force_function(engine64.tokens.call_ids(CALL))
        k = run_ticks(engine64, k, 12)
        outs = [drain(h) for h in handles]
        runs.append(outs)
        if with_call:
            assert any(isinstance(o, ToolCallStarted) for o in outs[7])
            assert any(isinstance(o, FunctionCall) for o in outs[7])
        k = close_all(engine64, handles, k)
    base, called = runs
    for i in range(64):
        if i == 7:
            continue
        a, b = frames(base[i]), frames(called[i])
        assert len(a) == len(b) == 11, i  # tick 0 prefills the prompt
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), f"session {i} changed"
        assert [o.text for o in base[i] if isinstance(o, AudioFrame)] == [
            o.text for o in called[i] if isinstance(o, AudioFrame)
        ]
    assert len(frames(called[7])) < 11  # it was paused


def test_tool_path_end_to_end(engine64):
    h = engine64.open_session(PROMPT, TOOLS)
    other = engine64.open_session(PROMPT, TOOLS)
    k = run_ticks(engine64, 1000, 1)
    assert h.phase == "live"
    h.push_audio(caller_audio(1, 0.4))
    other.push_audio(caller_audio(2, 4.0))
    h.force_function(engine64.tokens.call_ids(CALL))
    k = run_ticks(engine64, k, 3)
    items = drain(h)
    calls = [i for i in items if isinstance(i, FunctionCall)]
    assert [type(i).__name__ for i in items if not isinstance(i, AudioFrame)][:2] == [
        "ToolCallStarted",
        "FunctionCall",
    ]
    assert calls[0].name == "check_availability" and json.loads(calls[0].arguments) == {"guests": 2}
    assert h.phase == "waiting"
    # the caller keeps talking during the pause: 1.2 s of audio
    h.push_audio(caller_audio(3, 1.2))
    k = run_ticks(engine64, k, 3)
    assert not frames(drain(h))  # paused: no agent audio
    h.submit_tool_result(calls[0].call_id, json.dumps({"available": True, "rooms": [{"type": "deluxe"}]}))
    k = run_ticks(engine64, k, 4)
    items = drain(h)
    consumed = [i for i in items if isinstance(i, ToolResultConsumed)]
    assert consumed and h.phase == "live"
    assert consumed[0].call_ms >= 0 and consumed[0].resume_ms >= 0
    k = run_ticks(engine64, k, 2)
    assert len(frames(drain(h))) == 2  # live again: one frame per tick
    snap = {s.id: s for s in engine64.snapshot().sessions}[h.id]
    assert snap.frames_in == snap.frames_consumed == 5 + 15  # every frame pushed was consumed
    assert snap.frames_replayed >= 15 - 6
    assert snap.tool_calls == 1 and snap.tool_errors == 0
    ticks = [o.tick for o in drain(other) if isinstance(o, AudioFrame)]
    assert ticks == list(range(ticks[0], k)) and ticks[0] <= 1001  # the neighbour never paused
    for x in (h, other):
        x.close()
    run_ticks(engine64, k, 1)


@pytest.mark.parametrize("case", ["malformed", "unknown", "exception"])
def test_bad_calls_get_an_error_result_and_the_session_carries_on(engine64, case):
    h = engine64.open_session(PROMPT, TOOLS)
    bystander = engine64.open_session(PROMPT, TOOLS)
    k = run_ticks(engine64, 2000, 1)
    if case == "malformed":
        tokens = engine64.tokens
        ids = [
            tokens.call_start,
            *tokens.encode('<TOOLCALL>[{"name": "check_availability", "argu'),
            tokens.call_end,
        ]
        h.force_function(ids)
    elif case == "unknown":
        h.force_function(engine64.tokens.call_ids([{"name": "open_the_pod_bay_doors", "arguments": {}}]))
    else:
        h.force_function(engine64.tokens.call_ids(CALL))
    k = run_ticks(engine64, k, 3)
    items = drain(h)
    if case == "exception":
        call = next(i for i in items if isinstance(i, FunctionCall))
        h.submit_tool_result(call.call_id, "ValueError: the database is on fire", is_error=True)
    else:
        assert any(isinstance(i, ToolCallRejected) for i in items)
    k = run_ticks(engine64, k, 4)
    assert h.phase == "live"
    items += drain(h)
    assert any(isinstance(i, ToolResultConsumed) for i in items)
    snap = {s.id: s for s in engine64.snapshot().sessions}
    assert snap[h.id].tool_errors == (0 if case == "exception" else 1)
    ticks = [o.tick for o in drain(bystander) if isinstance(o, AudioFrame)]
    assert ticks == list(range(ticks[0], k)) and bystander.phase == "live"  # a frame every tick, unbothered
    for x in (h, bystander):
        x.close()
    run_ticks(engine64, k, 1)


def test_timeout_becomes_an_error_result():
    with engine_on(num_slots=2, tool_timeout_s=0.2) as e:
        h, k = waiting_on_a_call(e)
        assert h.phase == "waiting"
        e.clock.advance(0.25)  # the tool never answers
        k = run_ticks(e, k, 3)
        assert h.phase == "live"
        assert {s.id: s for s in e.snapshot().sessions}[h.id].tool_errors == 1


def test_a_full_engine_says_so_and_a_freed_slot_is_fresh():
    with engine_on(num_slots=4) as e:
        hs = [e.open_session(PROMPT, TOOLS) for _ in range(4)]
        assert e.occupancy == 1.0
        with pytest.raises(EngineFull, match="all 4 slots are in use"):
            e.open_session(PROMPT, TOOLS)
        for h in hs:
            h.push_audio(caller_audio(5, 1.0))
        k = run_ticks(e, 0, 8)
        slot = hs[2].slot
        hs[2].close()
        assert e.occupancy == 0.75  # free at once, not on the next tick: the next caller needn't wait
        reused = e.open_session(PROMPT, TOOLS)
        assert reused.slot == slot
        reused.push_audio(caller_audio(9, 0.8))
        for h in (hs[0], hs[1], hs[3]):
            h.close()
        run_ticks(e, k, 8)
        got = frames(drain(reused))
    with engine_on(num_slots=4) as fresh:
        for _ in range(slot):
            fresh.open_session(PROMPT, TOOLS).close()  # take the same slot number
        run_ticks(fresh, 0, 1)
        h = fresh.open_session(PROMPT, TOOLS)
        assert h.slot == slot
        h.push_audio(caller_audio(9, 0.8))
        run_ticks(fresh, 1, 8)
        want = frames(drain(h))
    assert len(got) == len(want) == 7
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_open_session_refuses_bad_tool_lists():
    with engine_on(num_slots=1) as e:
        with pytest.raises(SessionRejected, match="at most 5 tools"):
            e.open_session(PROMPT, [dict(TOOLS[0], name=f"t{i}") for i in range(6)])
        with pytest.raises(SessionRejected, match="distinct"):
            e.open_session(PROMPT, TOOLS + TOOLS)
        assert e.occupancy == 0


def test_tick_thread_delivers_on_the_callers_loop_and_serves_metrics():
    async def main():
        with Engine(EngineConfig(preset="tiny", num_slots=4, metrics_port=0)) as e:
            h = e.open_session(PROMPT, TOOLS, loop=asyncio.get_running_loop())
            h.push_audio(caller_audio(0, 1.0))
            got = []
            while len(got) < 6:
                got.append(await asyncio.wait_for(h.outputs.get(), timeout=60))  # an event, not a clock
            assert all(isinstance(g, AudioFrame) and g.samples.shape == (1764,) for g in got)
            assert [g.tick for g in got] == sorted(g.tick for g in got)
            url = f"http://127.0.0.1:{e.server.port}"
            snap = EngineSnapshot.model_validate_json(urllib.request.urlopen(url + "/snapshot").read())
            assert snap.ticks >= 6 and snap.sessions[0].id == h.id and snap.occupancy == 0.25
            h.push_audio(caller_audio(1, 0.24))  # live now: these frames are heard in the ticks they came for
            for _ in range(4):
                await asyncio.wait_for(h.outputs.get(), timeout=60)
            h.report_playout(0.12, 1, 0.05, 0.02)  # what a room's playout says of itself
            h.report_receive(0.045, 0.3)  # and its receive side (agent/audio_in/receive_stats.py)
            prom = urllib.request.urlopen(url + "/metrics").read().decode()
            assert (
                "chorus_live_step_seconds_bucket" in prom
                and "chorus_tick_seconds_bucket" in prom
                and "chorus_missed_deadlines_total" in prom
            )
            # what the buffers cost: every live frame's wait from arrival to output, and per slot the inbox's
            # reserve and the room's playout
            value = {
                line.split(" ")[0]: float(line.split(" ")[1])
                for line in prom.splitlines()
                if line.startswith("chorus_") and " " in line
            }
            assert value["chorus_heard_seconds_count"] >= 1 and value["chorus_heard_seconds_sum"] > 0
            slot = f'{{slot="{h.slot}"}}'
            assert value[f"chorus_playout_queued_seconds{slot}"] == 0.12
            assert (
                value[f"chorus_playout_gaps{slot}"] == 1
                and value[f"chorus_playout_gap_seconds{slot}"] == 0.05
            )
            assert f"chorus_inbox_reserve_frames{slot}" in value and "chorus_underrun_seconds_total" in value
            assert value[f"chorus_receive_jitter_buffer_seconds{slot}"] == 0.045
            assert value[f"chorus_receive_concealed_seconds{slot}"] == 0.3
            # the playout's report leaves the receive side's figures as they were, and the other way round
            h.report_playout(0.1, 1, 0.05, 0.02)
            row = {s.id: s for s in e.snapshot().sessions}[h.id]
            assert (row.rx_jitter_ms, row.rx_concealed_s, row.playout_ms) == (45.0, 0.3, 100.0)
            h.close()

    asyncio.run(main())


def test_caller_audio_of_any_float_precision_is_clipped_not_silenced():
    """float16 is a float too; a finite sample beyond the float32 range is loud (clipped to full scale), not
    turned into infinity and then silence; NaN and infinity are silence and counted."""
    inbox = FrameInbox(1280, 8)  # what `SessionHandle.push_audio` pushes into
    inbox.push(np.full(1280, 0.25, np.float16))
    inbox.push(np.full(1280, 1e39, np.float64))
    inbox.push(np.array([np.nan, np.inf, -np.inf] + [-5.0] * 1277, np.float64))
    frames = [inbox.pop() for _ in range(3)]
    assert frames[0].dtype == np.float32 and np.all(frames[0] == 0.25)
    assert np.all(frames[1] == 1.0)
    assert np.all(frames[2][:3] == 0.0) and np.all(frames[2][3:] == -1.0)
    assert inbox.nonfinite == 3


def test_a_huge_tool_result_is_cut_with_a_note_the_model_reads():
    with engine_on(num_slots=1, max_result_chars=1000) as e:
        h, k = waiting_on_a_call(e)
        call = next(i for i in drain(h) if isinstance(i, FunctionCall))
        h.submit_tool_result(call.call_id, "x" * 1_000_000)
        poll_between_ticks(e)  # the result's tokens are encoded off the tick thread
        assert h.phase == "waiting" and h._s.call.response is not None
        h._s.call.response.result(timeout=30)
        poll_between_ticks(e)
        ids = h._s.progress.prefill_ids
        text = e.tokens.decode(ids)
        assert "the result was cut: 1000000 characters, the first 1000 kept" in text
        assert len(ids) < 2000
        run_ticks(e, k, 4)
        assert h.phase == "live"


def test_distinct_new_prompts_are_admitted_a_few_at_a_time():
    """Each distinct prompt costs its own prefill: past `max_prompt_prefills` of them waiting at once, a new
    one is refused as overload, while sessions sharing a prompt already on its way are always admitted."""
    with engine_on(num_slots=8, max_prompt_prefills=2) as e:
        e.open_session("You are the concierge of the Harbour Hotel.", TOOLS)
        e.open_session("You are the concierge of the Quay Hotel.", TOOLS)
        with pytest.raises(EngineOverloaded, match="2 other system prompts are being prefilled"):
            e.open_session("You are the concierge of the Pier Hotel.", TOOLS)
        e.open_session("You are the concierge of the Quay Hotel.", TOOLS)  # shares a prefill on its way
        run_ticks(e, 0, 2)  # both prompts prefilled and cached
        e.open_session("You are the concierge of the Pier Hotel.", TOOLS)
        assert e.occupancy == 4 / 8


def test_the_tick_thread_frees_old_reference_cycles_in_its_slack():
    """A cycle that reached the collector's oldest generation is freed by the engine's once-a-minute full
    collection, run when the slack fits it, or after FORCE_AFTER periods whatever the slack. The engine's own
    clock decides when one is due."""
    import gc
    import weakref

    from engine.process.collector import EVERY_S, FORCE_AFTER

    class Node:
        pass

    clock = ManualClock()
    with engine_on(clock) as e:
        node = Node()
        node.me = node
        gone = weakref.ref(node)
        gc.collect(1)  # survives the young generations: only a full pass can free it now
        del node
        assert gone() is not None
        c = e.collector
        assert not c.maybe_collect(clock() + 1.0)  # within the minute: nothing yet
        assert c.runs == 0 and gone() is not None
        clock.advance(EVERY_S)
        assert not c.maybe_collect(clock())  # due, but no slack to spare
        assert c.runs == 0
        assert c.maybe_collect(clock() + 1.0)  # due and it fits
        assert c.runs == 1 and gone() is None
        clock.advance(FORCE_AFTER * EVERY_S)
        assert c.maybe_collect(clock())  # overdue: runs without slack
        assert c.runs == 2
