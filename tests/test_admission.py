"""Admission: a worker accepts a LiveKit job only with an engine slot reserved for it, and the session that
job opens takes that slot without being judged again
(engine.admit, SlotPool.reserve, agent.worker.on_request)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from agent import worker
from agent.settings import AgentSettings
from engine.api import EngineFull, EngineOverloaded
from engine.client.remote import RemoteEngine
from engine.tick.engine import Engine, EngineConfig
from engine.tick.slots import SlotPool


def test_a_reservation_holds_a_slot_until_redeemed_released_or_lapsed():
    now = [100.0]
    pool = SlotPool(2, clock=lambda: now[0])  # reservations lapse on the pool's clock, moved by hand
    a = pool.reserve("AJ_a", ttl_s=30)
    assert a == "AJ_a" and pool.holds(a)
    assert pool.available == 1 and pool.occupancy == 0.0  # reserved, not yet held by a session
    assert pool.reserve("AJ_a", ttl_s=30) == "AJ_a" and pool.available == 1  # asked again: still one slot
    pool.reserve("AJ_lapses", ttl_s=0.05)
    assert pool.available == 0
    with pytest.raises(EngineFull):
        pool.reserve("AJ_c", ttl_s=30)
    with pytest.raises(EngineFull):  # a session without a reservation finds no free slot
        pool.open(_session)
    now[0] += 0.04
    assert pool.available == 0 and pool.holds("AJ_lapses")  # not yet lapsed
    now[0] += 0.02  # the second lapsed: its slot is free again
    assert pool.available == 1 and not pool.holds("AJ_lapses")
    s = pool.open(_session, a)  # a's holder gets its slot
    assert pool.available == 1 and pool.occupancy == 0.5 and s.slot in (0, 1)
    assert not pool.holds(a)
    pool.release(a)  # already redeemed: nothing changes
    other = pool.open(_session)
    assert pool.available == 0 and pool.occupancy == 1.0 and other.slot != s.slot
    pool.close(s)
    c = pool.reserve("AJ_c", ttl_s=30)
    assert pool.available == 0
    pool.release(c)
    assert pool.available == 1 and pool.occupancy == 0.5


def _session(session_id: str, slot: int):
    from engine.tick.session import Session
    from engine.tick.slots import FrameInbox

    return Session(session_id, slot, frozenset(), FrameInbox(1280, 8), lambda items: None)


def test_an_admitted_session_opens_while_the_engine_reports_no_headroom():
    # any live step counts as too slow: the engine reports no headroom once it has measured enough ticks
    cfg = EngineConfig(preset="tiny", num_slots=2, device="cpu", overload_ratio=1e-9, recover_ratio=1e-9)
    engine = Engine(cfg)
    try:
        ticket = engine.admit("AJ_1")  # before the first judgement: admitted
        assert engine.pool.available == 1
        deadline = time.monotonic() + 30
        while not engine.overloaded:
            assert time.monotonic() < deadline, "the engine never judged its headroom"
            time.sleep(0.05)
        with pytest.raises(EngineOverloaded):
            engine.admit("AJ_2")
        with pytest.raises(EngineOverloaded):
            engine.open_session("You are a concierge.")
        with pytest.raises(EngineOverloaded):  # a job never admitted is judged as one without an admission
            engine.open_session("You are a concierge.", admission="AJ_2")
        handle = engine.open_session("You are a concierge.", admission=ticket)  # the promise is kept
        assert engine.occupancy == 0.5 and engine.pool.available == 1 and not handle.closed
        handle.close()
    finally:
        engine.close()


class FakeRequest:
    """The part of livekit-agents' JobRequest that the request function uses."""

    def __init__(self, job_id: str) -> None:
        self.id = job_id
        self.room = SimpleNamespace(name=f"room-{job_id}")
        self.answer: str | None = None

    async def accept(self, **_) -> None:
        self.answer = "accept"

    async def reject(self, **_) -> None:
        self.answer = "reject"


def test_the_request_function_turns_away_jobs_beyond_the_free_slots(seeded_env):
    settings = AgentSettings(slots=2, refuse_when_overloaded=False)
    requests = [FakeRequest(f"AJ_{i}") for i in range(3)]

    async def offer() -> None:
        for r in requests:  # three offers before any job has opened its session (the 0.5 s load sampling)
            await worker.on_request(r, settings)

    asyncio.run(offer())
    assert [r.answer for r in requests] == ["accept", "accept", "reject"]
    engine = worker.shared_engine(settings)  # the worker's end of its engine's process
    try:
        assert engine.status()["available"] == 0  # both accepted jobs hold their slot before their sessions
        engine.release("AJ_0")  # a job that ended before its call opened
        assert engine.status()["available"] == 1
        engine.release("AJ_0")  # twice is nothing more
        assert engine.status()["available"] == 1

        async def opened():  # the other job's session takes the slot reserved for it, not a free one
            loop = asyncio.get_running_loop()
            room = RemoteEngine()  # a room's end: the address and key the worker put in the environment
            return await asyncio.to_thread(
                room.open_session, "You are a concierge.", loop=loop, admission="AJ_1"
            )

        handle = asyncio.run(opened())
        assert engine.status()["available"] == 1 and engine.status()["occupancy"] == 0.5
        handle.close()
    finally:
        worker.close_shared()


class UnassignedRequest(FakeRequest):
    """A job the worker accepted that the server never assigned to it in time (a busy server)."""

    async def accept(self, **_) -> None:
        from livekit.agents import AssignmentTimeoutError

        raise AssignmentTimeoutError()


def test_a_job_the_server_did_not_assign_in_time_gives_its_slot_back_in_one_line(seeded_env, caplog):
    settings = AgentSettings(slots=1, refuse_when_overloaded=False)

    async def offer() -> None:
        await worker.on_request(UnassignedRequest("AJ_lost"), settings)  # raises nothing: not a defect
        taken = FakeRequest("AJ_next")
        await worker.on_request(taken, settings)
        assert taken.answer == "accept"  # the one slot was free again

    try:
        with caplog.at_level(logging.INFO, logger="chorus.agent.worker"):
            asyncio.run(offer())
        (line,) = [r for r in caplog.records if "AJ_lost" in r.getMessage()]
        assert "did not assign it in time" in line.getMessage() and line.exc_info is None
    finally:
        worker.close_shared()
