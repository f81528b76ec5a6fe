"""No caller left alone (agent/fleet/fleet.py), through the real LiveKit server and its Redis: two workers of
one agent name, a caller talking to one of them, and a fault: the room's own job process killed; or a caller
whose room's first dispatch found no worker; a rolling restart; a booking made before a SIGKILL. Each time the
caller hears an agent's voice again (a new agent, from a worker that can serve), within REHEARD_S of the
fault, and exactly one new agent answers. The worker SIGKILLed, its engine's process SIGKILLed and a worker
drained are played among mixed calls by the soak's CI form (tests/test_soak.py), held to the same bounds.

The agents are scripted by teacher forcing (CHORUS_TEACHER_FORCING=true, agent/forcing.py): the greeting that
is heard is forced on the model's text channel; the audio is the talker's and codec's, through WebRTC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid

import pytest
from livekit import api, rtc

from livekit_support import POLL_S, require_livekit, scripted_booking
from testkit.callers import Caller
from testkit.fleet import (
    heard_again,
    kill_job,
    one_fault,
    serving,
    two_workers,
)
from testkit.worker import Worker
from wait_support import await_until

pytestmark = pytest.mark.livekit

# The product's bound: a caller hears an agent again within 5 s of losing theirs. Measured here (2 cores, the
# server, two workers and the caller on one machine): 2.0-2.6 s after a SIGKILL (the missing connection found
# by two sweeps, the dispatch, the new job's join, its session's prompt and first words).
REHEARD_S = 5.0
AGENT = rtc.ParticipantKind.PARTICIPANT_KIND_AGENT


@pytest.fixture(scope="module")
def server():
    s = require_livekit()
    if not s.redis:
        pytest.fail("the LiveKit server runs without Redis (scripts/livekit.sh starts one with redis-server)")
    return s


def run_fault(server, store_dir, fault, **env: str) -> dict:
    """A caller on one of two workers; `fault(worker)` (the serving one) at a known moment; what followed."""
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"
    with two_workers(server, store_dir, name, **env) as stack:
        got = asyncio.run(one_fault(server, stack.workers, name, fault))
        logs = [w.log.read_text(errors="replace") for w in stack.workers]
    got["logs"] = logs
    print({k: v for k, v in got.items() if k != "logs"})
    return got


def check(got: dict, reason: str = "agent lost", first_words: str = "sorry, we were cut off") -> None:
    """Heard again in time, one new agent, one dispatch for `reason`, and the new agent carried the
    conversation on: its first words acknowledge the break (agent/fleet/carry.py)."""
    assert got["after_s"] <= REHEARD_S, got["after_s"]
    assert first_words in " ".join(got["said"]).lower(), got["said"]
    assert got["speakers"] == {got["agent"]}  # one new agent answered, and only it
    fleet = [line for log in got["logs"] for line in log.splitlines() if "chorus.agent.fleet" in line]
    assert sum("a new agent was dispatched" in line for line in fleet) == 1, fleet
    assert sum(f"({reason})" in line for line in fleet) == 1, fleet
    assert not any("disconnected" in c for c in got["connection"])  # the caller's own connection held


def test_a_rooms_job_that_crashes_leaves_no_caller_alone(server, store_dir):
    check(run_fault(server, store_dir, kill_job, CHORUS_ROOM_PROCESSES="true"))


def test_a_caller_whose_first_dispatch_found_no_worker_gets_an_agent(server, store_dir):
    """The caller joins while no worker of the agent's name is registered: the server's one dispatch finds no
    worker and is not tried again. A worker that registers afterwards finds the room alone and asks for its
    agent once the caller has waited FIRST_AGENT_S."""
    from agent.fleet.timing import FIRST_AGENT_S

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
    """A caller who stays in the room after the agent said goodbye and ended the call (the only worker
    drained, so none took the call over) is not sent another agent by a worker that starts afterwards: only a
    lost agent is replaced."""
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"

    async def call(stack: contextlib.ExitStack) -> Caller:
        first = Worker(server, store_dir, slots=2, name=name, CHORUS_DRAIN_TIMEOUT_S="12")
        stack.callback(first.stop)
        await asyncio.to_thread(first.start)
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
        await caller.join()
        await asyncio.wait_for(caller.first_speech.wait(), 60)
        first.signal(signal.SIGTERM)  # drains: with no other worker, the call ends with a goodbye
        gone = asyncio.Event()
        caller.room.on("participant_disconnected", lambda p: gone.set() if p.kind == AGENT else None)
        await asyncio.wait_for(gone.wait(), 60)
        later = Worker(server, store_dir, slots=2, name=name)
        stack.callback(later.stop)
        await asyncio.to_thread(later.start)
        await asyncio.sleep(8.0)  # the room stays with its caller alone, a worker free to serve it
        await caller.leave()
        return caller

    with contextlib.ExitStack() as stack:
        caller = asyncio.run(call(stack))
    assert len(caller.heard.agents) == 1, caller.heard.agents
    assert "goodbye" in caller.heard.text().lower()


ROLLING_CALLS = 8
# a replacement starts (its engine's process, its prompts prefilled) beside 8 live calls on 2 cores: measured
# from 106 s to over 120 s on a busy day, its imports starved by the calls' real-time audio threads
FRESH_START_S = 300.0
HANDOVER_GAP_S = 1.5


def test_a_rolling_restart_hands_every_call_over_and_answers_new_calls(server, store_dir):
    """8 calls on 2 workers; each worker in turn is replaced: a new one is started, then the old one drains
    (SIGTERM). Each of its calls is handed to an agent of another worker (agent/fleet/fleet.py, "Handed
    over"): the caller stays connected, hears no goodbye, and hears the new agent's voice within
    HANDOVER_GAP_S of the draining one leaving it; a caller who calls during each drain is answered; the old
    worker exits 0 once its calls are handed over."""
    name = f"chorus-test-{uuid.uuid4().hex[:8]}"
    env = {"CHORUS_DRAIN_TIMEOUT_S": "90"}

    def worker(stack: contextlib.ExitStack) -> Worker:
        w = Worker(server, store_dir, slots=6, name=name, **env)
        stack.callback(w.stop)
        return w.launch()

    def latest(caller: Caller) -> str:
        return max(caller.heard.speech_at.items(), key=lambda kv: kv[1])[0]

    async def run(stack: contextlib.ExitStack) -> dict:
        callers: list[Caller] = []
        try:
            return await roll(stack, callers)
        finally:  # however it ends: a caller left connected would load every test after this one
            await asyncio.gather(*(c.leave() for c in callers))

    async def roll(stack: contextlib.ExitStack, callers: list[Caller]) -> dict:
        old = [worker(stack), worker(stack)]
        for w in old:
            await asyncio.to_thread(w.start)
        callers += [Caller(server, f"roll-{i}-{uuid.uuid4().hex[:6]}", name) for i in range(ROLLING_CALLS)]
        theirs_all = list(callers)
        for c in theirs_all:
            await c.join()
        await asyncio.gather(*(asyncio.wait_for(c.first_speech.wait(), 90) for c in theirs_all))
        loop = asyncio.get_running_loop()
        waits, gaps, codes, steps = [], [], [], []
        live = list(old)
        for victim in old:
            fresh = await asyncio.to_thread(worker(stack).start, FRESH_START_S)
            live.append(fresh)
            await await_until(
                lambda: all(serving(live, c) for c in theirs_all), "every call's worker", 30, every=POLL_S
            )
            theirs = [c for c in theirs_all if serving([victim], c)]
            before = {id(c): latest(c) for c in theirs}
            t0 = loop.time()
            victim.signal(signal.SIGTERM)
            newcomer = Caller(server, f"roll-new-{uuid.uuid4().hex[:6]}", name)
            callers.append(newcomer)
            await newcomer.join()
            for c in theirs:
                agent, after = await heard_again(c, before[id(c)], t0, REHEARD_S)
                old_agent = before[id(c)]
                await await_until(lambda c=c, a=old_agent: a in c.heard.left_at, "the old agent gone", 30)
                waits.append(after)
                # the caller between the two agents: from the draining one leaving to the new one's voice
                left = c.heard.left_at[old_agent]
                gaps.append(max(0.0, c.heard.speech_at[agent] - left))
                # where a gap was spent: the new agent's track subscribed, its first frame, its voice
                steps.append(
                    [
                        round(at.get(agent, float("nan")) - left, 2)
                        for at in (c.heard.track_at, c.heard.audio_at)
                    ]
                )
            await asyncio.wait_for(newcomer.first_speech.wait(), 60)
            codes.append(await asyncio.to_thread(victim.wait, 60))
            live.remove(victim)
        return {
            "waits": sorted(round(w, 2) for w in waits),
            "gaps": sorted(round(g, 2) for g in gaps),
            "steps": [[round(g, 2), *s] for g, s in sorted(zip(gaps, steps))],  # after the old agent left
            "codes": codes,
            "connections": [list(c.heard.connection) for c in theirs_all],  # before they leave
            "words": [c.heard.text().lower() for c in theirs_all],
            "agents": [len(c.heard.agents) for c in theirs_all],
        }

    with contextlib.ExitStack() as stack:
        got = asyncio.run(run(stack))
    print(got["waits"], got["gaps"], got["agents"], got["codes"], got["steps"])
    assert got["codes"] == [0, 0]  # each drained worker exited cleanly, its calls handed over
    assert len(got["waits"]) >= ROLLING_CALLS  # every call was handed over at least once
    # the draining agent talks on until the caller has the new one's track and its session is live: the caller
    # is between the two only from its leaving to the new one's voice (measured 0-0.9 s, a core kept busy
    # or not; the bound allows the spread of a busier machine)
    assert max(got["gaps"]) <= HANDOVER_GAP_S, got["steps"]  # [voice, track, first frame] after the leave
    assert not any("disconnected" in " ".join(c) for c in got["connections"]), got["connections"]
    assert not any("goodbye" in w for w in got["words"])  # no call was closed


def test_a_booking_made_before_a_sigkill_exists_once_after_the_call_resumes(server, store_dir):
    """The agent books a room (a scripted `book_room`), then its worker is killed. The new agent carries the
    call on (agent/fleet/carry.py): its first words acknowledge the break (their start: the script's booking,
    1 s into the session, cuts them short as it cut the first greeting), and its script asks for the same
    booking again, which the conversation's key makes the one booking already made."""
    import sqlite3

    metadata, _ = scripted_booking(days_ahead=12, at_s=1.0)
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


@pytest.mark.parametrize("closed", ["emptied", "deleted"])
def test_a_new_agent_finding_its_callers_room_closed_deletes_the_conversation_kept_for_it(
    server, store_dir, closed
):
    """The caller hung up just as their agent was lost: the new agent the fleet sent (a dispatch with the
    fleet's metadata, made here) waits in the room without them until the server closes it, once its
    departure timeout has passed since the caller left (`emptied`), or at once (`deleted`, by the API). No job
    is left to end that call on purpose, so the new one deletes the conversation kept for it, and releases the
    room; the job ends without an error."""
    from agent.fleet.carry import Conversation
    from agent.fleet.fleet import REASON_KEY, REDISPATCH_KEY
    from agent.fleet.marks import Keys
    from tools.store import open_store

    name = f"chorus-test-{uuid.uuid4().hex[:8]}"
    room_name = f"fleet-{uuid.uuid4().hex[:8]}"

    def kept(sid: str) -> str | None:
        with open_store() as store:
            return store.transact(lambda tx: tx.conversation(sid))

    async def run(worker: Worker) -> tuple[str | None, str | None, int]:
        lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
        redis = server.redis_client()
        try:
            room = await lk.room.create_room(api.CreateRoomRequest(name=room_name, departure_timeout=6))
            if closed == "emptied":  # the caller was in the room, and hung up
                caller = rtc.Room()
                grant = api.VideoGrants(room_join=True, room=room_name)
                token = api.AccessToken(server.key, server.secret).with_identity("caller").with_grants(grant)
                await caller.connect(server.url, token.to_jwt())
                await caller.disconnect()
            said = Conversation("AJ_lost")
            said.said = ["Welcome to the Grand Hotel."]
            with open_store() as store:
                store.transact(lambda tx: tx.put_conversation(room.sid, said.to_json()), write=True)
            before = kept(room.sid)
            meta = json.dumps({REDISPATCH_KEY: 1, REASON_KEY: "agent lost"})
            await lk.agent_dispatch.create_dispatch(
                api.CreateAgentDispatchRequest(agent_name=name, room=room_name, metadata=meta)
            )

            async def agents() -> int:
                people = await lk.room.list_participants(api.ListParticipantsRequest(room=room_name))
                return sum(p.kind == api.ParticipantInfo.Kind.AGENT for p in people.participants)

            deadline = asyncio.get_running_loop().time() + 60
            while not await agents():
                assert asyncio.get_running_loop().time() < deadline, "the new agent never joined"
                await asyncio.sleep(POLL_S)
            await await_until(  # its job waits for the caller (connected: a busy machine slows that)
                lambda: "replaces the room's lost agent" in worker.log.read_text(errors="replace"),
                "the new agent's job waiting for its caller",
                60,
                every=POLL_S,
            )
            if closed == "deleted":
                await lk.room.delete_room(api.DeleteRoomRequest(room=room_name))
            await await_until(lambda: kept(room.sid) is None, "the conversation deleted", 30, every=POLL_S)
            await await_until(
                lambda: "the room closed before a caller came" in worker.log.read_text(errors="replace"),
                "the job's end",
                30,
                every=POLL_S,
            )
            # released after the conversation is deleted and the job's end logged: asked until it is, or 30 s
            deadline = asyncio.get_running_loop().time() + 30
            while not (ended := await redis.exists(Keys(name).ended(room.sid))):
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(POLL_S)
            return before, kept(room.sid), ended
        finally:
            await lk.aclose()
            await redis.aclose()

    with contextlib.ExitStack() as stack:
        worker = Worker(server, store_dir, slots=2, name=name)
        stack.callback(worker.stop)
        worker.start()
        before, after, ended = asyncio.run(run(worker))
        log = worker.log.read_text(errors="replace")
    assert before is not None and after is None
    assert ended == 1  # released: a caller who comes back to a room of that name is a new call
    assert "unhandled exception" not in log
