"""The tick thread's priority (engine/process/priority.py), at the tiny preset with dummy weights: the live
step runs under SCHED_FIFO, the paused work after it (here a teacher-forced tool call's tokens) at normal
priority, and the thread is real-time again before it sleeps; a process the kernel refuses a real-time
priority runs its ticks all the same, says so once, and shows it in the snapshot. Ticks are driven by hand on
the test's thread, which is given back its normal policy after each test. The effect on the live step beside
busy rooms is measured by `benchmarks/room_cost.py` (docs/benchmarks.md), not here."""

from __future__ import annotations

import logging
import os

import pytest

from engine.api import FunctionCall
from engine.process.priority import TickPriority
from engine.tick.engine import Engine, EngineConfig
from engine_support import CALL, ManualClock, drain, run_ticks
from testkit.concierge import PROMPT, TOOLS


def realtime_allowed() -> bool:
    try:
        os.sched_setscheduler(
            0, os.SCHED_FIFO, os.sched_param(EngineConfig.model_fields["tick_priority"].default)
        )
    except OSError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


@pytest.fixture
def normal_policy_after():
    yield
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # the test's thread as it was


@pytest.mark.skipif(not realtime_allowed(), reason="this process may not take a real-time priority")
def test_the_live_step_is_real_time_and_the_slack_work_is_not(normal_policy_after):
    engine = Engine(EngineConfig(preset="tiny", num_slots=2, start=False), clock=ManualClock())
    seen: dict[str, list[int]] = {"live": [], "tool": []}
    live, tool = engine.runner.live, engine.runner.tool

    def spy_live(plan):
        seen["live"].append(os.sched_getscheduler(0))
        return live(plan)

    def spy_tool(work):
        seen["tool"].append(os.sched_getscheduler(0))
        return tool(work)

    engine.runner.live, engine.runner.tool = spy_live, spy_tool
    try:
        assert engine.priority.start()  # as the tick thread does when it starts
        h = engine.open_session(PROMPT, TOOLS)
        k = run_ticks(engine, 0, 1)
        h.force_function(engine.tokens.call_ids(CALL))
        run_ticks(engine, k, 3)
        assert any(isinstance(i, FunctionCall) for i in drain(h))  # the call's tokens ran as slack work
        assert seen["live"] and set(seen["live"]) == {os.SCHED_FIFO}
        assert seen["tool"] and set(seen["tool"]) == {os.SCHED_OTHER}
        assert os.sched_getscheduler(0) == os.SCHED_FIFO  # real-time again before the thread sleeps
        assert engine.snapshot().tick_realtime
    finally:
        engine.close()


def test_a_refused_priority_leaves_the_ticks_at_normal_priority_and_says_so_once(monkeypatch, caplog):
    def refuse(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    engine = Engine(EngineConfig(preset="tiny", num_slots=1, start=False), clock=ManualClock())
    try:
        with caplog.at_level(logging.WARNING, logger="chorus.engine.priority"):
            assert not engine.priority.start()
        assert [r.getMessage() for r in caplog.records if "normal priority" in r.getMessage()] != []
        assert len(caplog.records) == 1
        h = engine.open_session(PROMPT, TOOLS)
        k = run_ticks(engine, 0, 1)
        h.force_function(engine.tokens.call_ids(CALL))
        run_ticks(engine, k, 3)  # slack work with nothing to relax: no further attempt, no error
        assert any(isinstance(i, FunctionCall) for i in drain(h))
        assert not engine.snapshot().tick_realtime
    finally:
        engine.close()


def test_priority_zero_leaves_the_thread_alone():
    p = TickPriority(0)
    before = os.sched_getscheduler(0)
    assert not p.start()
    p.relax()
    p.restore()
    assert os.sched_getscheduler(0) == before and not p.realtime
