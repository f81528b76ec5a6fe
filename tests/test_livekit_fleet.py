"""No caller left alone (agent/fleet.py), through the real LiveKit server and its Redis: two workers of one
agent name, a caller talking to one of them, and a fault: the worker killed with SIGKILL, its engine's process
killed under it, the room's own job process killed; or a caller whose room's first dispatch found no worker.
Each time the caller hears an agent's voice again (a new agent, from a worker that can serve), within
REHEARD_S of the fault, and exactly one new agent answers.

The agents are scripted by teacher forcing (CHORUS_TEACHER_FORCING=true, agent/forcing.py): the greeting that
is heard is forced on the model's text channel; the audio is the talker's and codec's, through WebRTC.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid

import pytest
from livekit import rtc

from benchmarks.support.callers import Caller
from benchmarks.support.machine import cmdline, tree
from benchmarks.support.worker import Worker, sessions_by_label
from livekit_support import POLL_S, require_livekit
from wait_support import await_until

pytestmark = pytest.mark.livekit

# The product's bound is 5 s from a room's agent lost to an agent heard again: the mark's expiry (2 s), a
# sweep (0.5 s), the dispatch, the new job's join and the greeting's first frame. Beside the server, two
# workers and the callers on this 2-core machine, the join and the first frame take longer than on a worker's
# host: the test allows the same steps their spread here.
REHEARD_S = 8.0
AGENT = rtc.ParticipantKind.PARTICIPANT_KIND_AGENT


@pytest.fixture(scope="module")
def server():
    s = require_livekit()
    if not s.redis:
        pytest.fail("the LiveKit server runs without Redis (scripts/livekit.sh starts one with redis-server)")
    return s


def serving(workers: list[Worker], caller: Caller) -> Worker | None:
    """The worker whose engine holds the caller's session."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            if caller.room_name in sessions_by_label(w.snapshot()):
                return w
    return None


async def heard_again(caller: Caller, first: str, since: float, within: float) -> tuple[str, float]:
    """The new agent whose voice the caller heard after `since` (loop time), and when, after it."""

    def new_voice() -> tuple[str, float] | None:
        for agent, at in caller.heard.speech_at.items():
            if agent != first and at > since:
                return agent, at - since
        return None

    await await_until(lambda: new_voice() is not None, "a new agent's voice", within + 60, every=POLL_S)
    return new_voice()


def two_workers(server, store_dir, name: str, **env: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    workers = [Worker(server, store_dir, slots=2, name=name, **env) for _ in range(2)]
    for w in workers:
        stack.callback(w.stop)
        w.launch()
    for w in workers:
        w.start()
    stack.workers = workers
    return stack


def run_fault(server, store_dir, fault, **env: str) -> dict:
    """A caller on one of two workers; `fault(worker)` (the serving one) at a known moment; what followed."""
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"

    async def call(workers: list[Worker]) -> dict:
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
        await caller.join()
        await asyncio.wait_for(caller.first_speech.wait(), 60)
        first = caller.heard.agent_identity
        await await_until(lambda: serving(workers, caller), "the serving worker", 30, every=POLL_S)
        victim = serving(workers, caller)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fault(victim)
        agent, after = await heard_again(caller, first, t0, REHEARD_S)
        await asyncio.sleep(3.0)  # long enough for a second new agent, if one were wrongly sent
        out = {
            "after_s": after,
            "agent": agent,
            "first": first,
            "agents": set(caller.heard.agents),
            "speakers": {a for a, at in caller.heard.speech_at.items() if at > t0},
            "victim": workers.index(victim),
        }
        await caller.leave()
        return out

    with two_workers(server, store_dir, name, **env) as stack:
        got = asyncio.run(call(stack.workers))
        logs = [w.log.read_text(errors="replace") for w in stack.workers]
    got["logs"] = logs
    print({k: v for k, v in got.items() if k != "logs"})
    return got


def check(got: dict) -> None:
    assert got["after_s"] <= REHEARD_S, got["after_s"]
    assert got["speakers"] == {got["agent"]}  # one new agent answered, and only it
    fleet = [line for log in got["logs"] for line in log.splitlines() if "chorus.agent.fleet" in line]
    assert sum("a new agent was dispatched" in line for line in fleet) == 1, fleet


def test_a_worker_killed_with_sigkill_leaves_no_caller_alone(server, store_dir):
    got = run_fault(server, store_dir, lambda w: w.proc.send_signal(signal.SIGKILL))
    check(got)


def test_an_engine_that_dies_under_its_worker_leaves_no_caller_alone(server, store_dir):
    def kill_engine(w: Worker) -> None:
        engine = next(p for p in tree(w.proc.pid)[1:] if "engine.serve" in cmdline(p))
        os.kill(engine, signal.SIGKILL)

    got = run_fault(server, store_dir, kill_engine)
    check(got)
    assert "the engine's process ended" in got["logs"][got["victim"]]


def test_a_rooms_job_that_crashes_leaves_no_caller_alone(server, store_dir):
    def kill_job(w: Worker) -> None:  # the room's own process (livekit-agents' process executor)
        rooms = [p for p in tree(w.proc.pid)[1:] if "engine.serve" not in cmdline(p)]
        busy = [p for p in rooms if _holds_a_session(p)]
        os.kill(busy[0], signal.SIGKILL)

    got = run_fault(server, store_dir, kill_job, CHORUS_ROOM_PROCESSES="true")
    check(got)


def _holds_a_session(pid: int) -> bool:
    """A room's process that holds a session on the engine: one that maps a session's shared memory."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("chorus-session" in line for line in f)
    except OSError:
        return False


def test_a_caller_whose_first_dispatch_found_no_worker_gets_an_agent(server, store_dir):
    """The caller joins while no worker of the agent's name is registered: the server's one dispatch finds no
    worker and is not tried again. A worker that registers afterwards finds the room alone and asks for its
    agent once the caller has waited FIRST_AGENT_S."""
    from agent.fleet import FIRST_AGENT_S

    name = f"chorus-test-{uuid.uuid4().hex[:8]}"

    async def call() -> tuple[float, dict]:
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
        await caller.join()
        loop = asyncio.get_running_loop()
        joined = loop.time()
        with two_workers(server, store_dir, name) as stack:
            ready = loop.time()
            await await_until(lambda: caller.heard.speech_at, "an agent's voice", 90, every=POLL_S)
            heard = min(caller.heard.speech_at.values())
            logs = [w.log.read_text(errors="replace") for w in stack.workers]
        await caller.leave()
        wait = heard - max(ready, joined + FIRST_AGENT_S)
        return wait, {"agents": caller.heard.agents, "logs": logs, "ready_after_join": ready - joined}

    wait, got = asyncio.run(call())
    print(f"heard {wait:.1f} s after the workers were up and the caller had waited; {got['agents']}")
    assert wait <= REHEARD_S
    assert len(got["agents"]) == 1
    assert sum(log.count("never answered") for log in got["logs"]) == 1


def test_a_call_that_ends_on_purpose_leaves_its_room_to_nobody(server, store_dir):
    """A caller who stays in the room after the agent said goodbye and ended the call (a drained worker's
    goodbye) is not sent another agent: only a lost agent is replaced."""
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"

    async def call(workers: list[Worker]) -> Caller:
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
        await caller.join()
        await asyncio.wait_for(caller.first_speech.wait(), 60)
        victim = serving(workers, caller)
        victim.signal(signal.SIGTERM)  # drains: the call ends with a goodbye (CHORUS_DRAIN_TIMEOUT_S below)
        gone = asyncio.Event()
        caller.room.on("participant_disconnected", lambda p: gone.set() if p.kind == AGENT else None)
        await asyncio.wait_for(gone.wait(), 60)
        await asyncio.sleep(8.0)  # the room stays with its caller alone
        await caller.leave()
        return caller

    stack = contextlib.ExitStack()
    workers = [Worker(server, store_dir, slots=2, name=name, CHORUS_DRAIN_TIMEOUT_S="12") for _ in range(2)]
    with stack:
        for w in workers:
            stack.callback(w.stop)
            w.launch()
        for w in workers:
            w.start()
        caller = asyncio.run(call(workers))
    assert len(caller.heard.agents) == 1, caller.heard.agents
    assert "goodbye" in caller.heard.text().lower()


def test_a_booking_made_before_a_sigkill_exists_once_after_the_call_resumes(server, store_dir):
    """The agent books a room (a scripted `book_room`), then its worker is killed. The new agent carries the
    call on (agent/carry.py): its first words acknowledge the break (their start: the script's booking, 1 s
    into the session, cuts them short as it cut the first greeting), and its script asks for the same booking
    again, which the conversation's key makes the one booking already made."""
    import datetime as dt
    import json
    import sqlite3

    check_in = dt.date.today() + dt.timedelta(days=12)
    booking = {
        "guest_name": "Test Rowan",
        "contact": "rowan@example.com",
        "check_in": check_in.isoformat(),
        "check_out": (check_in + dt.timedelta(days=2)).isoformat(),
        "guests": 2,
        "room_type": "standard",
    }
    metadata = json.dumps({"script": {"calls": [{"at_s": 1.0, "name": "book_room", "arguments": booking}]}})
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"

    def rows() -> list[tuple]:
        with contextlib.closing(sqlite3.connect(store_dir / "hotel.sqlite3")) as db:
            return db.execute("SELECT guest_name, status FROM reservations").fetchall()

    async def call(workers: list[Worker]) -> tuple[Caller, str, str]:
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name, metadata=metadata)
        await caller.join()
        first = None
        await await_until(lambda: rows(), "the booking", 60, every=POLL_S)
        await await_until(
            lambda: "thanks for waiting" in caller.heard.text().lower(),
            "the words after it",
            60,
            every=POLL_S,
        )
        first = caller.heard.agent_identity
        victim = serving(workers, caller)
        victim.proc.send_signal(signal.SIGKILL)

        def second_said(words: str) -> str | None:
            return next(
                (s for s, t, _ in caller.heard.transcripts if s != first and words in t.lower()), None
            )

        await await_until(
            lambda: second_said("sorry, we were"),
            "the new agent's acknowledgement",
            60,
            every=POLL_S,
            seen=lambda: (caller.heard.transcripts, [w.log.read_text()[-3000:] for w in workers]),
        )
        await await_until(lambda: second_said("thanks for waiting"), "its booking's answer", 60, every=POLL_S)
        agent = second_said("sorry, we were")
        await caller.leave()
        return caller, first, agent

    with two_workers(server, store_dir, name) as stack:
        caller, first, second = asyncio.run(call(stack.workers))
        booked = rows()
    said = [t for s, t, _ in caller.heard.transcripts if s == second]
    print(f"the new agent said {said}; bookings {booked}")
    assert second and second != first
    assert booked == [("Test Rowan", "confirmed")]  # asked for on both sides of the break: made once
