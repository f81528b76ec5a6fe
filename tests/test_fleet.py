"""The fleet's watch (agent/fleet/fleet.py) against a real Redis (redis-server, started here on a free port)
and LiveKit's API as a stand-in that holds rooms, participants and dispatches: a room whose live mark lapsed
gets one new dispatch however many workers find it alone; a room whose call ended on purpose, a room of
another agent and a caller still within the first dispatch's time get none; a job's end unmarks only its own
mark. The real server is tests/test_livekit_fleet.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import time

import pytest
from livekit import api, rtc

from agent.fleet import fleet, marks, room_job, state, timing
from agent.settings import AgentSettings
from fleet_support import FakeLiveKit
from fleet_support import fixture as _redis_url  # noqa: F401 (the fixture `redis_url`)

pytestmark = [  # a Redis of its own; the watch's sweeps on the wall clock (serial: tests/conftest.py)
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.serial,
]


def present_fleet(redis_url: str, worker: str) -> fleet.Fleet:
    """Worker `worker`'s part in the fleet of agent "desk", with its presence connection (it is alive)."""
    return fleet.Fleet(
        marks.redis_client(redis_url),
        "desk",
        worker,
        presence=marks.redis_client(redis_url, name=marks.presence_name("desk", worker)),
    )


def test_a_room_whose_agent_was_lost_gets_one_new_agent_however_many_workers_watch(redis_url, monkeypatch):
    monkeypatch.setattr(timing, "LIVE_MS", 300)
    lk = FakeLiveKit()
    now = time.time()
    room = lk.add("lobby", "desk", caller_joined=now - 60, meta=json.dumps({"script": "greet"}))
    other = lk.add("elsewhere", "another-agent", caller_joined=now - 60)

    async def main():
        a, b = (fleet.Fleet(marks.redis_client(redis_url), "desk", w) for w in ("w-a", "w-b"))
        await a.beat([(room.sid, "AJ_1")])
        assert await a.sweep(lk) == 0 and await b.sweep(lk) == 0  # live: nobody acts
        await asyncio.sleep(0.5)  # the worker that served it stopped marking it (killed): the mark lapses
        asked = [await a.sweep(lk), await b.sweep(lk), await b.sweep(lk), await a.sweep(lk)]
        counts = a.counts["agent lost"] + b.counts["agent lost"]
        for f in (a, b):
            await f.redis.aclose()
        return asked, counts

    asked, counts = asyncio.run(main())
    assert sum(asked) == 1 and counts == 1  # one new dispatch, from whichever claimed the room first
    assert [(d.room, d.agent_name) for d in lk.created] == [("lobby", "desk")]
    meta = json.loads(lk.created[0].metadata)
    assert meta == {"script": "greet", fleet.REDISPATCH_KEY: 1, fleet.REASON_KEY: "agent lost"}
    assert room_job.redispatched(lk.created[0].metadata) == meta
    assert other.name not in [d.room for d in lk.created]  # another agent's room is not ours


def test_a_caller_still_within_the_first_dispatchs_time_is_left_to_it_and_then_gets_an_agent(redis_url):
    lk = FakeLiveKit()
    clock = [1000.0]
    room = lk.add("new-room", "desk", caller_joined=1000.0)

    async def main():
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a", clock=lambda: clock[0])
        early = await f.sweep(lk)
        clock[0] += timing.FIRST_AGENT_S
        late = await f.sweep(lk)
        await f.redis.aclose()
        return early, late, f.counts

    early, late, counts = asyncio.run(main())
    assert (early, late) == (0, 1) and counts["never answered"] == 1
    assert json.loads(lk.created[0].metadata)[fleet.REASON_KEY] == "never answered"
    assert room.name == lk.created[0].room


def test_a_jobs_end_unmarks_its_own_mark_only_and_a_call_ended_on_purpose_gets_no_new_agent(redis_url):
    lk = FakeLiveKit()
    room = lk.add("suite", "desk", caller_joined=time.time() - 60)
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")

    async def main():
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        keys = marks.Keys("desk")
        await f.beat([(room.sid, "AJ_old")])
        await f.redis.set(keys.live(room.sid), "w-b AJ_new")  # a newer job (another worker's) marked it since
        await f.beat([])  # the old job ended here: the newer job's mark stays
        kept = await f.redis.get(keys.live(room.sid))
        await f.redis.delete(keys.live(room.sid))
        await room_job.release_room(settings, room.sid)  # the newer job's call ended on purpose
        asked = await f.sweep(lk)
        await f.redis.aclose()
        return kept, asked

    kept, asked = asyncio.run(main())
    assert kept == b"w-b AJ_new"
    assert asked == 0 and not lk.created


def test_a_served_room_whose_caller_left_while_it_had_no_agent_is_over_once_and_a_caller_back_is_a_new_call(
    redis_url, monkeypatch
):
    """The caller hung up in the silence after their agent was lost: no job is left to end the call on
    purpose, so the watch finds it over after OVER_S (its conversation is then deleted by the worker), once;
    the room is no longer served, and a caller who comes back to it is a new call (the first dispatch's)."""
    monkeypatch.setattr(timing, "OVER_S", 0.3)
    lk = FakeLiveKit()
    room = lk.add("garden", "desk", caller_joined=time.time() - 60)
    callers = list(lk.rooms["garden"][1])
    gone = lk.add("lobby", "desk", caller_joined=time.time() - 60)  # its caller left with its agent live

    async def main():
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        keys = marks.Keys("desk")
        await f.beat([(room.sid, "AJ_1"), (gone.sid, "AJ_2")])
        await f.redis.delete(keys.live(room.sid))  # the garden's agent lost (its mark lapsed)
        lk.rooms["garden"][1].clear()
        lk.rooms["lobby"][1].clear()
        first = (await f.sweep(lk), list(f.over))
        await asyncio.sleep(0.4)
        second = (await f.sweep(lk), list(f.over))
        third = (await f.sweep(lk), list(f.over))
        served = await f.redis.exists(keys.served(room.sid))
        lk.rooms["garden"][1].extend(callers)  # back (joined 60 s ago: past the first dispatch's time)
        back = await f.sweep(lk)
        await f.redis.aclose()
        return first, second, third, served, back

    first, second, third, served, back = asyncio.run(main())
    assert first == (0, []) and second == (0, [room.sid]) and third == (0, [])
    assert served == 0
    assert back == 1 and lk.created[-1].room == "garden"
    assert json.loads(lk.created[-1].metadata).get(fleet.REASON_KEY) == "never answered"


def test_a_worker_whose_process_died_has_its_rooms_served_before_their_marks_expire(redis_url):
    """A worker's presence is its named connection to Redis: its process killed (SIGKILL, in a process of
    its own here), the kernel closes that connection, and another worker asks for a new agent from its second
    sweep that finds the name gone, while the dead worker's live mark has not yet expired. A worker whose
    connection is back within GONE_S (a reconnect) keeps its rooms."""
    import signal
    import sys

    lk = FakeLiveKit()
    room = lk.add("annex", "desk", caller_joined=time.time() - 60)
    other = lk.add("garden", "desk", caller_joined=time.time() - 60)
    dead = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from agent.fleet import marks; import redis;"
            "name = marks.presence_name('desk', 'w-a');"
            "r = redis.Redis.from_url('redis://' + sys.argv[1], client_name=name);"
            "r.ping(); r.set(marks.Keys('desk').live('RM_annex'), 'w-a AJ_1', px=60000);"
            "r.set(marks.Keys('desk').served('RM_annex'), 'AJ_1'); print('up', flush=True); time.sleep(600)",
            redis_url,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def main():
        watcher = present_fleet(redis_url, "w-b")
        await watcher.beat([])
        live = present_fleet(redis_url, "w-c")
        await live.beat([(other.sid, "AJ_2")])
        first = [await watcher.sweep(lk)]  # the other worker is there: its room is live
        await asyncio.sleep(timing.GONE_S + 0.05)
        first.append(await watcher.sweep(lk))
        # a worker reconnecting: its connection missing at one sweep, back before the next
        await live.presence.aclose()
        first.append(await watcher.sweep(lk))
        await live.beat([(other.sid, "AJ_2")])  # its beat opens it again
        await asyncio.sleep(timing.GONE_S + 0.05)
        first.append(await watcher.sweep(lk))
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        t0 = time.monotonic()
        asked = 0
        while not asked and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
            asked = await watcher.sweep(lk)
        took = time.monotonic() - t0
        mark = await watcher.redis.pttl(marks.Keys("desk").live(room.sid))
        for f in (watcher, live):
            await f.redis.aclose()
            await f.presence.aclose()
        return first, asked, took, mark

    try:
        assert dead.stdout.readline().strip() == "up"
        first, asked, took, mark = asyncio.run(main())
    finally:
        dead.kill()
        dead.wait(10)
    assert first == [0, 0, 0, 0]
    assert asked == 1 and [d.room for d in lk.created] == [room.name]
    assert mark > 0  # its mark (60 s here) had not expired: the missing connection told
    print(f"a dead worker's room was asked an agent for {took:.2f} s after its process was killed")


class Link(rtc.EventEmitter):
    """A job's rtc room as `watch_link` reads it: its connection's state, set by the test, and the SDK's
    `reconnected` event."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = rtc.ConnectionState.CONN_CONNECTED, rtc.ConnectionState.CONN_RECONNECTING
        self.connection_state = self.up


def test_a_job_whose_room_connection_is_down_leaves_its_room_to_the_fleet_and_leaves_once_replaced(
    redis_url, monkeypatch
):
    """A LiveKit node dies under a job: its worker lives and marks the room live at every beat, but the job's
    own connection to the room is down. Past DOWN_GRACE_S the job marks the room down and the fleet finds it
    alone (a blip shorter than that does nothing); a new agent's job then marks it, and when the old job's
    connection comes back it finds the room another's and leaves. A job whose connection comes back with no
    one else in its place keeps its call, and its mark is gone."""
    monkeypatch.setattr(timing, "BEAT_S", 0.02)
    monkeypatch.setattr(timing, "DOWN_GRACE_S", 0.2)
    lk = FakeLiveKit()
    room = lk.add("terrace", "desk", caller_joined=time.time() - 60)
    calm = lk.add("spa", "desk", caller_joined=time.time() - 60)
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    keys = marks.Keys("desk")

    async def main():
        worker = present_fleet(redis_url, "w-old")  # alive throughout: its named connection stays
        other = present_fleet(redis_url, "w-new")
        await worker.beat([(room.sid, "AJ_old"), (calm.sid, "AJ_calm")])
        links, events = {"AJ_old": Link(), "AJ_calm": Link()}, []
        tasks = [
            asyncio.create_task(
                room_job.watch_link(
                    links[job],
                    settings,
                    sid,
                    job,
                    lambda down, job=job: events.append((job, "down" if down else "up")),
                    lambda job=job: events.append((job, "replaced")),
                )
            )
            for sid, job in ((room.sid, "AJ_old"), (calm.sid, "AJ_calm"))
        ]
        # a blip shorter than the grace: nothing happens
        links["AJ_calm"].connection_state = links["AJ_calm"].down
        await asyncio.sleep(0.08)
        links["AJ_calm"].connection_state = links["AJ_calm"].up
        links["AJ_old"].connection_state = links["AJ_old"].down
        await asyncio.sleep(0.08)
        early = await other.sweep(lk)  # within the grace: the room is still its agent's
        await asyncio.sleep(0.3)
        await worker.beat([(room.sid, "AJ_old"), (calm.sid, "AJ_calm")])  # its worker marks it still
        asked = await other.sweep(lk)
        down = await other.redis.get(keys.down(room.sid))
        await other.beat([(room.sid, "AJ_new")])  # the new agent's job, dispatched for it
        links["AJ_old"].connection_state = links["AJ_old"].up  # the old agent's connection is back
        await asyncio.wait_for(tasks[0], 5)  # it leaves: the watch ends
        tasks[1].cancel()
        gone = await other.redis.get(keys.down(room.sid))
        for f in (worker, other):
            await f.redis.aclose()
        await worker.presence.aclose()
        await other.presence.aclose()
        return early, asked, down, gone, events

    early, asked, down, gone, events = asyncio.run(main())
    assert early == 0 and asked == 1 and [d.room for d in lk.created] == [room.name]
    assert json.loads(lk.created[0].metadata)[fleet.REASON_KEY] == "agent lost"
    assert down == b"AJ_old" and gone is None
    assert events == [("AJ_old", "down"), ("AJ_old", "replaced")]  # the blip's job: no event


def test_a_job_that_ends_with_its_connection_down_leaves_its_room_alone_while_its_worker_still_lists_it(
    redis_url, monkeypatch
):
    """A LiveKit node dies under a job, whose SDK gives up: the job ends while its connection is down, and the
    server drops its agent from the room. Its worker lists the job, and marks the room live at every beat,
    until the job's process has exited: the room, its agent seen in it before, must not be held by that mark
    meanwhile. The job's watch, cancelled by the job's end, leaves the room marked down (ENDED_DOWN_MS), so
    the worker's beats no longer mark it live and another worker's sweep finds the caller alone at once."""
    monkeypatch.setattr(timing, "BEAT_S", 0.02)
    monkeypatch.setattr(timing, "DOWN_GRACE_S", 10.0)  # ends before its grace: marked down by its end alone
    lk = FakeLiveKit()
    room = lk.add("boathouse", "desk", caller_joined=time.time() - 60)
    lk.agent("boathouse", "AJ_gone")
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    keys = marks.Keys("desk")

    async def main():
        worker = present_fleet(redis_url, "w-a")
        other = present_fleet(redis_url, "w-b")
        jobs = [(room.sid, "AJ_gone")]
        await worker.beat(jobs)
        held = await other.sweep(lk)  # its agent in the room: held (and agreed with)
        link = Link()
        task = asyncio.create_task(
            room_job.watch_link(link, settings, room.sid, "AJ_gone", lambda d: None, lambda: None)
        )
        await asyncio.sleep(0.05)
        link.connection_state = link.down
        await asyncio.sleep(0.05)
        lk.rooms["boathouse"][1].pop()  # the server drops its agent
        task.cancel()  # the job ends
        await asyncio.wait({task}, timeout=5)
        ttl = await other.redis.pttl(keys.down(room.sid))
        await worker.beat(jobs)  # its process not exited yet: its worker lists it still
        asked = await other.sweep(lk)
        await other.redis.delete(*(k(room.sid) for k in (keys.live, keys.down, keys.claim, keys.served)))
        for f in (worker, other):
            await f.redis.aclose()
            await f.presence.aclose()
        return held, ttl, asked

    held, ttl, asked = asyncio.run(main())
    assert held == 0 and timing.ENDED_DOWN_MS - 5_000 < ttl <= timing.ENDED_DOWN_MS
    assert asked == 1 and [d.room for d in lk.created] == [room.name]


def test_a_job_back_in_its_room_alone_keeps_it(redis_url, monkeypatch):
    monkeypatch.setattr(timing, "BEAT_S", 0.02)
    monkeypatch.setattr(timing, "DOWN_GRACE_S", 0.05)
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    keys = marks.Keys("desk")

    async def main():
        worker = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        await worker.beat([("RM_roof", "AJ_1")])
        link, events = Link(), []
        task = asyncio.create_task(
            room_job.watch_link(
                link, settings, "RM_roof", "AJ_1", lambda d: events.append(d), lambda: events.append("x")
            )
        )
        link.connection_state = link.down
        await asyncio.sleep(0.2)
        during = await worker.redis.get(keys.down("RM_roof"))
        link.connection_state = link.up
        await asyncio.sleep(0.2)
        after = await worker.redis.get(keys.down("RM_roof"))
        task.cancel()
        await worker.redis.aclose()
        return during, after, events

    during, after, events = asyncio.run(main())
    assert during == b"AJ_1" and after is None and events == [True, False]


def test_a_new_job_for_a_room_another_job_holds_is_told_which_unless_that_one_is_down_or_its_worker_dead(
    redis_url,
):
    """A room made again on another node keeps its sid, and the server dispatches its agent again: the new
    job finds the room held by the job that is up in it (its worker's presence connection listed), and not
    held when that job's connection is down, when that job's worker is gone, or when the mark is its own."""
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    keys = marks.Keys("desk")

    async def main():
        presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-a"))
        await presence.ping()
        r = marks.redis_client(redis_url)
        seen = {"no mark": await room_job.holder(settings, "RM_x", "AJ_new")}
        await r.set(keys.live("RM_x"), "w-a AJ_old")
        seen["held"] = await room_job.holder(settings, "RM_x", "AJ_new")
        seen["own"] = await room_job.holder(settings, "RM_x", "AJ_old")
        await r.set(keys.down("RM_x"), "AJ_old")
        seen["down"] = await room_job.holder(settings, "RM_x", "AJ_new")
        await r.delete(keys.down("RM_x"))
        await presence.aclose()  # the worker's process died: its named connection is gone
        await asyncio.sleep(0.05)
        seen["worker gone"] = await room_job.holder(settings, "RM_x", "AJ_new")
        await r.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen == {"no mark": None, "held": "AJ_old", "own": None, "down": None, "worker gone": None}


def test_a_room_whose_participants_cannot_be_listed_does_not_stop_the_sweep_for_the_others(redis_url):
    from agent.lkapi import LiveKitFailure

    lk = FakeLiveKit()
    lost = lk.add("a-lost-node", "desk", caller_joined=time.time() - 60)
    fine = lk.add("b-fine", "desk", caller_joined=time.time() - 60)
    listing = lk.list_participants

    async def list_participants(req):
        if req.room == lost.name:  # the room's node just died
            raise LiveKitFailure("list_participants", "the room's node does not answer")
        return await listing(req)

    lk.api.room.list_participants = list_participants

    async def main():
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        r = f.redis
        for room in (lost, fine):
            await r.set(marks.Keys("desk").served(room.sid), "AJ_gone")
        asked = await f.sweep(lk)
        await r.aclose()
        return asked

    assert asyncio.run(main()) == 1 and [d.room for d in lk.created] == [fine.name]


def test_a_reconnect_too_quick_to_be_seen_down_still_finds_the_room_replaced(redis_url, monkeypatch):
    """The SDK rebuilt the agent's connection between two polls (its `reconnected` event): if another job
    marked the room meanwhile (a new agent, dispatched while this one's connection led to a node that died),
    this one leaves at once; if not, nothing happens."""
    monkeypatch.setattr(timing, "BEAT_S", 0.5)
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")

    async def main():
        r = marks.redis_client(redis_url)
        presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-b"))
        await r.set(marks.Keys("desk").live("RM_q"), "w-a AJ_mine")
        link, events = Link(), []
        task = asyncio.create_task(
            room_job.watch_link(
                link, settings, "RM_q", "AJ_mine", events.append, lambda: events.append("left")
            )
        )
        await asyncio.sleep(0.05)
        link.emit("reconnected")  # its own mark still: it stays
        await asyncio.sleep(0.1)
        stayed = not task.done()
        await r.set(marks.Keys("desk").live("RM_q"), "w-b AJ_new")
        await presence.ping()  # w-b's worker is alive
        t0 = time.monotonic()
        link.emit("reconnected")
        await asyncio.wait_for(task, 5)
        took = time.monotonic() - t0
        await r.aclose()
        await presence.aclose()
        return stayed, took, events

    stayed, took, events = asyncio.run(main())
    assert stayed and events == ["left"]
    assert took < timing.BEAT_S  # at the event, not at the next poll


def test_a_room_made_again_on_another_node_without_its_agent_gets_one_though_its_mark_is_live(
    redis_url, monkeypatch
):
    """A room's node died and its caller's SDK made it again on another node (LiveKit's `room_node_map` in
    Redis names the new one), while its agent's connection still leads to the dead node and its job, up as
    far as it knows, keeps the room marked live. Once the room has had a caller and no agent for
    ABSENT_S, it is alone; a room that moved with its agent in it, or that never moved, is not."""
    monkeypatch.setattr(timing, "ABSENT_S", 0.2)
    lk = FakeLiveKit()
    moved = lk.add("ballroom", "desk", caller_joined=time.time() - 60)
    followed = lk.add("library", "desk", caller_joined=time.time() - 60)
    stayed = lk.add("bar", "desk", caller_joined=time.time() - 60)
    agent = api.ParticipantInfo.Kind.AGENT
    active = api.ParticipantInfo.State.ACTIVE
    # the server lists what its nodes stored in Redis: the agent left on the dead node, joined before its
    # caller came back to the room made again; and in the other room the agent that came back with it
    lk.rooms["ballroom"][1].append(
        api.ParticipantInfo(identity="agent-AJ_1", kind=agent, state=active, joined_at=int(time.time()) - 120)
    )
    lk.rooms["library"][1].append(
        api.ParticipantInfo(identity="agent-AJ_2", kind=agent, state=active, joined_at=int(time.time()))
    )

    async def main():
        presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-a"))
        worker = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a", presence=presence)
        watcher = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-b")
        r = watcher.redis
        jobs = [(moved.sid, "AJ_1"), (followed.sid, "AJ_2"), (stayed.sid, "AJ_3")]
        for room in (moved, followed, stayed):
            await r.hset(state.NODE_MAP, room.name, "ND_dead")
        await worker.beat(jobs)
        before = await watcher.sweep(lk)  # seen on their first node
        await r.hset(state.NODE_MAP, moved.name, "ND_live")  # made again on the node that lives
        await r.hset(state.NODE_MAP, followed.name, "ND_live")
        at_once = await watcher.sweep(lk)  # within the grace: the agent may be rejoining
        await asyncio.sleep(0.25)
        await worker.beat(jobs)  # the jobs, up as far as they know, mark their rooms still
        later = await watcher.sweep(lk)
        down = await r.get(marks.Keys("desk").down(moved.sid))
        await r.delete(state.NODE_MAP)
        for f in (worker, watcher):
            await f.redis.aclose()
        await presence.aclose()
        return before, at_once, later, down

    before, at_once, later, down = asyncio.run(main())
    assert (before, at_once, later) == (0, 0, 1)
    assert down == b"AJ_1"  # its job is taken as down: the new agent's job takes the room over
    assert [d.room for d in lk.created] == [moved.name]
    assert json.loads(lk.created[0].metadata)[fleet.REASON_KEY] == "agent lost"


def test_a_rooms_mark_stays_with_the_job_there_first_unless_that_one_is_down_or_its_worker_dead(redis_url):
    """Two workers with a job each for one room (the server's dispatch for a room made again, beside the
    fleet's): the job marked first keeps the mark at every beat of both, so the other, looking, leaves. A
    job whose connection is down is not marked, and its mark gives way; a dead worker's mark gives way at
    once."""
    keys = marks.Keys("desk")

    async def main():
        a, b = present_fleet(redis_url, "w-a"), present_fleet(redis_url, "w-b")
        r = a.redis
        seen = []
        for _ in range(2):
            await a.beat([("RM_m", "AJ_a")])
            await b.beat([("RM_m", "AJ_b")])
            seen.append(await r.get(keys.live("RM_m")))
        await r.set(keys.down("RM_m"), "AJ_a", px=5000)  # a's job lost its connection
        await a.beat([("RM_m", "AJ_a")])
        seen.append(await r.get(keys.live("RM_m")))  # not marked while down
        await b.beat([("RM_m", "AJ_b")])
        seen.append(await r.get(keys.live("RM_m")))  # gives way to b's
        await r.delete(keys.down("RM_m"))
        await a.beat([("RM_m", "AJ_a")])
        seen.append(await r.get(keys.live("RM_m")))  # back up, but b's is there now: b keeps it
        await b.presence.aclose()  # b's process died
        await asyncio.sleep(0.05)
        await a.beat([("RM_m", "AJ_a")])
        seen.append(await r.get(keys.live("RM_m")))
        for f in (a, b):
            await f.redis.aclose()
        await a.presence.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen == [b"w-a AJ_a", b"w-a AJ_a", b"w-a AJ_a", b"w-b AJ_b", b"w-b AJ_b", b"w-a AJ_a"]


def test_a_dispatch_that_fails_gives_its_claim_back_and_is_asked_again_at_the_next_sweep(redis_url):
    from agent.lkapi import LiveKitFailure

    lk = FakeLiveKit()
    room = lk.add("cellar", "desk", caller_joined=time.time() - 60)
    create = lk.create_dispatch
    fails = [1]

    async def create_dispatch(req):
        if fails:  # the room's node died under the request
            fails.pop()
            raise LiveKitFailure("create_dispatch", "no answer in time")
        return await create(req)

    lk.api.agent_dispatch.create_dispatch = create_dispatch

    async def main():
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        await f.redis.set(marks.Keys("desk").served(room.sid), "AJ_gone")
        asked = [await f.sweep(lk), await f.sweep(lk)]
        times = await f.redis.get(marks.Keys("desk").count(room.sid))
        await f.redis.aclose()
        return asked, times

    asked, times = asyncio.run(main())
    assert asked == [0, 1] and [d.room for d in lk.created] == [room.name]
    assert times == b"1" and json.loads(lk.created[0].metadata)[fleet.REDISPATCH_KEY] == 1


def test_a_worker_keeps_its_rooms_marked_while_its_sweep_waits_on_a_slow_server(redis_url):
    """A sweep waits on LiveKit's API, seconds on a busy server (a rolling restart under load saw 10 s); the
    worker's marks go on meanwhile, so no other worker takes its rooms for alone and sends them a second
    agent. Sampled over three lifetimes of a mark, while the sweep's first look at the rooms is still
    waiting."""
    from agent.fleet import worker_watch

    lk = FakeLiveKit()
    lifetime_s = timing.LIVE_MS / 1000

    async def list_rooms(_req):
        await asyncio.sleep(4 * lifetime_s)
        return api.ListRoomsResponse(rooms=[])

    lk.api.room.list_rooms = list_rooms
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    live = marks.Keys("desk").live("RM_busy")

    async def main():
        watch = asyncio.create_task(
            worker_watch.watch(settings, "w-busy", lambda: [("RM_busy", "AJ_1")], livekit=lambda _s: lk)
        )
        r = marks.redis_client(redis_url)
        seen = []
        for _ in range(6):
            await asyncio.sleep(lifetime_s / 2)
            seen.append(await r.get(live))
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await r.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen == [b"w-busy AJ_1"] * 6, seen


def test_a_room_a_new_job_marked_while_the_sweep_looked_at_it_is_not_sent_another(redis_url):
    """A sweep finds a room alone, then waits on LiveKit's API for its participants; meanwhile the agent
    dispatched before reaches the room and its worker marks it. The sweep looks at the marks once more
    before it asks: no second agent is sent, and the claim is given back."""
    lk = FakeLiveKit()
    room = lk.add("atrium", "desk", caller_joined=time.time() - 60)
    listed = lk.list_participants

    async def main():
        a, b = (fleet.Fleet(marks.redis_client(redis_url), "desk", w) for w in ("w-a", "w-b"))

        async def list_participants(req):
            await b.beat([(room.sid, "AJ_new")])  # the new agent's worker, during the look
            return await listed(req)

        lk.api.room.list_participants = list_participants
        asked = await a.sweep(lk)
        claim = await a.redis.get(marks.Keys("desk").claim(room.sid))
        for f in (a, b):
            await f.redis.aclose()
        return asked, claim

    asked, claim = asyncio.run(main())
    assert asked == 0 and not lk.created and claim is None


def test_of_two_jobs_one_worker_runs_for_one_room_the_oldest_up_keeps_the_mark(redis_url):
    """Two dispatches raced for one room and one worker took both: the older job, up in the room, keeps the
    mark (the newer finds the room held by it, and leaves); once the older one's connection is down, the
    newer is marked."""
    settings = AgentSettings(redis_url=redis_url, agent_name="desk")
    keys = marks.Keys("desk")

    async def main():
        presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-two"))
        f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-two", presence=presence)
        seen = []
        for _ in range(2):
            await f.beat([("RM_two", "AJ_older"), ("RM_two", "AJ_newer")])
            seen.append(await f.redis.get(keys.live("RM_two")))
        seen.append(await room_job.holder(settings, "RM_two", "AJ_newer"))
        await f.redis.set(keys.down("RM_two"), "AJ_older", px=5000)
        await f.beat([("RM_two", "AJ_older"), ("RM_two", "AJ_newer")])
        seen.append(await f.redis.get(keys.live("RM_two")))
        await f.redis.aclose()
        await presence.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen == [b"w-two AJ_older", b"w-two AJ_older", "AJ_older", b"w-two AJ_newer"], seen


async def draining(redis_url: str, rooms: list[api.Room]):
    """Worker w-old, alive (its presence connection), draining: each of `rooms` served by its job AJ_old and
    marked handed over. Returns its connection."""
    keys = marks.Keys("desk")
    drainer = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-old"))
    await drainer.ping()
    for r in rooms:
        await drainer.set(keys.served(r.sid), "AJ_old")
        await drainer.set(keys.drained(r.sid), "w-old", ex=60)
    return drainer


def test_a_drains_calls_are_handed_over_a_few_at_a_time_across_the_workers(redis_url):
    """A draining worker's six rooms are all alone at once; the two workers that sweep ask for new agents for
    HANDOVERS_AT_ONCE of them (the same ones: the lowest sids) and for no more while those are on their way;
    as new agents mark their rooms, the rest are asked for. The draining agents talk on meanwhile."""
    lk = FakeLiveKit()
    now = time.time()
    rooms = [lk.add(f"suite-{i}", "desk", caller_joined=now - 60) for i in range(6)]

    async def main():
        drainer = await draining(redis_url, rooms)
        a, b = (fleet.Fleet(marks.redis_client(redis_url), "desk", w) for w in ("w-a", "w-b"))
        asked = [await a.sweep(lk) + await b.sweep(lk)]
        first = sorted(d.room for d in lk.created)
        asked.append(await b.sweep(lk) + await a.sweep(lk))  # on their way: nothing more
        await b.beat([(r.sid, f"AJ_new{i}") for i, r in enumerate(rooms) if r.name in first[:2]])
        asked.append(await a.sweep(lk) + await b.sweep(lk))
        for f in (a, b):
            await f.redis.aclose()
        await drainer.aclose()
        return asked, first

    asked, first = asyncio.run(main())
    assert asked == [timing.HANDOVERS_AT_ONCE, 0, 2], asked
    assert first == sorted(r.name for r in rooms)[: timing.HANDOVERS_AT_ONCE]
    assert sorted(d.room for d in lk.created) == sorted(r.name for r in rooms)  # each room once
    assert {json.loads(d.metadata)[fleet.REASON_KEY] for d in lk.created} == {"handed over"}


def test_a_handover_whose_new_agent_marks_the_room_before_the_dispatch_is_answered_holds_no_turn(redis_url):
    """On a busy server the answer to a dispatch can come after its job has launched and marked the room: the
    handover is done then, and the turn it took is free at the next sweep, while the draining worker, whose
    agent talks on, still marks the room handed over (the turn was held HANDING_MS, and a drain's fifth call
    waited 30 s for it)."""
    lk = FakeLiveKit()
    now = time.time()
    rooms = [
        lk.add(f"annex-{i}", "desk", caller_joined=now - 60) for i in range(timing.HANDOVERS_AT_ONCE + 1)
    ]
    keys = marks.Keys("desk")
    create = lk.create_dispatch

    async def main():
        drainer = await draining(redis_url, rooms)
        a = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        b = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-b")  # where the new agents run

        async def create_dispatch(req):  # the new job launched and marked its room before the answer
            made = await create(req)
            sid = next(r.sid for r in rooms if r.name == req.room)
            await b.beat([*((s, j) for s, j in b.marked.items()), (sid, f"AJ_{req.room}")])
            # the draining worker's beat marks its rooms handed over while its agents talk on
            await drainer.set(keys.drained(sid), "w-old", ex=60)
            return made

        lk.api.agent_dispatch.create_dispatch = create_dispatch
        asked = [await a.sweep(lk), await a.sweep(lk)]
        left = [await a.redis.exists(keys.handover_asked(r.sid)) for r in rooms]
        for f in (a, b):
            await f.redis.aclose()
        await drainer.aclose()
        return asked, left

    asked, left = asyncio.run(main())
    assert asked == [timing.HANDOVERS_AT_ONCE, 1], asked  # the last one at the next sweep
    assert left == [0] * len(rooms)
    assert sorted(d.room for d in lk.created) == sorted(r.name for r in rooms)


def test_the_rooms_of_a_draining_worker_that_died_are_not_kept_waiting_their_turn(redis_url):
    """A draining worker dies while its calls wait their turn to be handed over: they are lost calls now,
    asked for at once, not HANDOVERS_AT_ONCE at a time."""
    lk = FakeLiveKit()
    now = time.time()
    rooms = [lk.add(f"wing-{i}", "desk", caller_joined=now - 60) for i in range(10)]
    keys = marks.Keys("desk")

    async def main():
        a = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
        for r in rooms:  # handed over by w-gone, whose presence connection is not in Redis: it died
            await a.redis.set(keys.served(r.sid), "AJ_old")
            await a.redis.set(keys.drained(r.sid), "w-gone", ex=60)
        asked = [await a.sweep(lk)]  # its connection found missing (not yet for GONE_S)
        await asyncio.sleep(timing.GONE_S + 0.05)
        asked.append(await a.sweep(lk))
        await a.redis.aclose()
        return asked

    asked = asyncio.run(main())
    reasons = [json.loads(d.metadata)[fleet.REASON_KEY] for d in lk.created]
    at_once = timing.HANDOVERS_AT_ONCE
    assert asked == [at_once, 10 - at_once], asked  # the rest at once
    assert reasons == ["handed over"] * at_once + ["agent lost"] * (10 - at_once)


def forger(redis_url: str, worker: str = "w-x"):
    """A client of the fleet's Redis that holds its password, and a presence connection named after a worker
    that does not exist: what someone who can write there forges."""
    return marks.redis_client(redis_url), marks.redis_client(
        redis_url, name=marks.presence_name("desk", worker)
    )


def test_a_live_mark_for_a_job_livekit_does_not_list_neither_keeps_a_room_from_its_agent_nor_off_the_fleet(
    redis_url, monkeypatch
):
    """A live mark for a made-up job, its worker's presence connection open: a room whose agent LiveKit lists
    in it is not taken for alone (no second agent), and a room whose agent was lost is given one once the
    mark has stood JOIN_S without its agent coming in (a new job's agent joins within it)."""
    monkeypatch.setattr(timing, "JOIN_S", 0.3)
    lk = FakeLiveKit()
    kept = lk.add("suite", "desk", caller_joined=time.time() - 60)
    lost = lk.add("attic", "desk", caller_joined=time.time() - 60)
    lk.agent("suite", "AJ_real")
    keys = marks.Keys("desk")

    async def main():
        presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-a"))
        worker = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a", presence=presence)
        watcher = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-b")
        bad, bad_presence = forger(redis_url)
        await bad_presence.ping()
        await worker.beat([(kept.sid, "AJ_real")])
        await worker.beat([])  # the lost room's job ended with its worker's next beat: served, no mark
        await bad.set(keys.served(lost.sid), "AJ_gone")
        for room in (kept, lost):
            await bad.set(keys.live(room.sid), "w-x AJ_fake")
        asked = [await watcher.sweep(lk)]  # within JOIN_S: believed
        await asyncio.sleep(0.35)
        await worker.beat([(kept.sid, "AJ_real")])  # held by the forged mark: the real job's is not set
        asked.append(await watcher.sweep(lk))
        asked.append(await watcher.sweep(lk))  # claimed already: no second dispatch
        for c in (worker.redis, watcher.redis, presence, bad, bad_presence):
            await c.aclose()
        return asked

    asked = asyncio.run(main())
    assert asked == [0, 1, 0]
    assert [d.room for d in lk.created] == [lost.name]


def test_a_job_does_not_leave_its_room_for_a_live_mark_livekit_does_not_agree_with(redis_url, monkeypatch):
    """A new job's look at its room (`holder`) and a running job's (`watch_link`): a live mark naming another
    job, of a worker whose presence connection is open, holds the room only where LiveKit lists that job's
    agent in it or started that job within JOIN_S; a made-up job's mark is not believed, and is removed so
    the room's own job's worker marks it."""
    monkeypatch.setattr(timing, "BEAT_S", 0.02)
    monkeypatch.setattr(timing, "HELD_S", 0.05)
    lk = FakeLiveKit()
    room = lk.add("garden", "desk", caller_joined=time.time() - 60)
    lk.agent("garden", "AJ_real")
    lk.agent("garden", "AJ_old")
    lk.job("garden", "AJ_racing", started=time.time())  # dispatched a moment ago: its agent is joining
    lk.job("garden", "AJ_stale", started=time.time() - 60)  # long ago, and not in the room
    monkeypatch.setattr(room_job, "_livekit", lambda _settings: lk)
    settings = AgentSettings(
        redis_url=redis_url,
        agent_name="desk",
        livekit_url="ws://lk",
        livekit_api_key="k",
        livekit_api_secret="s",
    )
    keys = marks.Keys("desk")

    async def main():
        bad, bad_presence = forger(redis_url)
        await bad_presence.ping()
        seen = {}
        for other in ("AJ_fake", "AJ_stale", "AJ_racing", "AJ_old"):
            await bad.set(keys.live(room.sid), f"w-x {other}")
            seen[other] = await room_job.holder(settings, room.sid, "AJ_new")
        await bad.set(keys.live(room.sid), "w-x AJ_fake")
        link, events = Link(), []
        link.name = room.name
        task = asyncio.create_task(
            room_job.watch_link(
                link, settings, room.sid, "AJ_real", events.append, lambda: events.append("left")
            )
        )
        await asyncio.sleep(0.4)  # several looks
        stayed = not task.done()
        task.cancel()
        mark = await bad.get(keys.live(room.sid))
        for c in (bad, bad_presence):
            await c.aclose()
        return seen, stayed, events, mark

    seen, stayed, events, mark = asyncio.run(main())
    assert seen == {"AJ_fake": None, "AJ_stale": None, "AJ_racing": "AJ_racing", "AJ_old": "AJ_old"}
    assert stayed and events == []
    assert mark is None  # the forged mark removed: the real job's worker marks the room at its next beat


def served_room(name: str) -> tuple[FakeLiveKit, api.Room]:
    """A room of agent `desk` with a caller of a minute and the agent of job AJ_real."""
    lk = FakeLiveKit()
    room = lk.add(name, "desk", caller_joined=time.time() - 60)
    lk.agent(name, "AJ_real")
    return lk, room


def without_agents(lk: FakeLiveKit, name: str) -> None:
    """The room's agents gone from it, as LiveKit lists it."""
    lk.rooms[name][1][:] = [p for p in lk.rooms[name][1] if p.kind != api.ParticipantInfo.Kind.AGENT]


@contextlib.asynccontextmanager
async def forged_room(redis_url: str):
    """(worker w-a, its presence connection open; worker w-b watching; a client that forges marks)."""
    presence = marks.redis_client(redis_url, name=marks.presence_name("desk", "w-a"))
    worker = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a", presence=presence)
    watcher = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-b")
    bad, _ = forger(redis_url)
    try:
        yield worker, watcher, bad
    finally:
        for c in (worker.redis, watcher.redis, presence, bad):
            await c.aclose()


def test_a_down_mark_for_a_job_whose_agent_livekit_lists_in_the_room_does_not_swap_its_agent(
    redis_url, monkeypatch
):
    """A down mark for a job that is up, its agent in the room as LiveKit lists it: no new agent is sent,
    neither while the job's worker's mark stands nor once it lapsed (a worker does not mark a job that is
    down); once LiveKit no longer lists the agent in the room, the down mark counts and the room is alone."""
    monkeypatch.setattr(timing, "LIVE_MS", 200)
    lk, room = served_room("pool")
    keys = marks.Keys("desk")

    async def main():
        async with forged_room(redis_url) as (worker, watcher, bad):
            await worker.beat([(room.sid, "AJ_real")])
            await bad.set(keys.down(room.sid), "AJ_real")
            asked = [await watcher.sweep(lk)]  # its mark stands
            await asyncio.sleep(0.25)
            await worker.beat([(room.sid, "AJ_real")])
            asked.append(await watcher.sweep(lk))  # its mark lapsed
            without_agents(lk, "pool")
            asked.append(await watcher.sweep(lk))  # its agent gone from the room: the down mark counts
        return asked

    asked = asyncio.run(main())
    assert asked == [0, 0, 1]
    assert json.loads(lk.created[0].metadata)[fleet.REASON_KEY] == "agent lost"


def test_a_forged_down_mark_removed_before_the_jobs_worker_marks_again_does_not_swap_its_agent(
    redis_url, monkeypatch
):
    """Whoever forged a down mark removes it: until the job's worker marks the room again (its next beat),
    the room has no mark at all. A mark forged there lately, a missing one is asked of LiveKit too: its agent
    in the room, no new agent is sent; its agent gone, the room is alone as any served room without one."""
    monkeypatch.setattr(timing, "LIVE_MS", 200)
    lk, room = served_room("spa")
    keys = marks.Keys("desk")

    async def main():
        async with forged_room(redis_url) as (worker, watcher, bad):
            await worker.beat([(room.sid, "AJ_real")])
            await bad.set(keys.down(room.sid), "AJ_real")
            await asyncio.sleep(0.25)  # the job's mark lapsed (a worker does not mark a job that is down)
            asked = [await watcher.sweep(lk)]
            await bad.delete(keys.down(room.sid))  # no mark at all until the next beat
            asked.append(await watcher.sweep(lk))
            without_agents(lk, "spa")
            asked.append(await watcher.sweep(lk))  # its agent gone from the room: alone
        return asked

    assert asyncio.run(main()) == [0, 0, 1]


def test_a_worker_whose_presence_connection_fails_marks_its_rooms_still_and_says_so_once(redis_url, caplog):
    """A worker's presence connection that cannot be pinged (closed by someone, over and over): its rooms
    are marked at every beat all the same, and the failure is one warning line, not one per beat."""
    with socket.socket() as s:  # a port nothing listens on: every ping fails
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    keys = marks.Keys("desk")

    async def main():
        presence = marks.redis_client(f"127.0.0.1:{dead}", name=marks.presence_name("desk", "w-a"))
        worker = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a", presence=presence)
        seen = []
        for _ in range(3):
            await worker.beat([("RM_deck", "AJ_1")])
            seen.append(await worker.redis.get(keys.live("RM_deck")))
            await worker.redis.delete(keys.live("RM_deck"))
        await worker.redis.aclose()
        await presence.aclose()
        return seen

    with caplog.at_level("WARNING", logger="chorus.agent.fleet"):
        seen = asyncio.run(main())
    assert seen == [b"w-a AJ_1"] * 3
    assert sum("presence connection failed" in r.getMessage() for r in caplog.records) == 1


def test_workers_log_in_to_a_redis_behind_a_password_by_their_settings_or_its_url():
    """A Redis that asks for a password: a worker's client logs in with CHORUS_REDIS_PASSWORD (winning over
    a URL's own), or with a redis:// URL that carries it; without it, every command is refused."""
    from redis.exceptions import AuthenticationError, ResponseError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", "s3cret"],
        stdout=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"

    async def main():
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        said = {}
        for how, client in {
            "settings": marks.fleet_redis(AgentSettings(redis_url=address, redis_password="s3cret")),
            "url": marks.fleet_redis(AgentSettings(redis_url=f"redis://:s3cret@{address}")),
            "settings over url": marks.fleet_redis(
                AgentSettings(redis_url=f"redis://:wrong@{address}", redis_password="s3cret")
            ),
            "none": marks.fleet_redis(AgentSettings(redis_url=address)),
        }.items():
            try:
                said[how] = await client.set("chorus:desk:live:RM_x", "w-a AJ_1")
            except (AuthenticationError, ResponseError) as e:
                said[how] = str(e).split()[0]
            finally:
                await client.aclose()
        return said

    try:
        said = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(10)
    assert said == {"settings": True, "url": True, "settings over url": True, "none": "Authentication"}
