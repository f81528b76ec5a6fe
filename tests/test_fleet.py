"""The fleet's watch (agent/fleet.py) against a real Redis (redis-server, started here on a free port) and
LiveKit's API as a stand-in that holds rooms, participants and dispatches: a room whose live mark lapsed gets
one new dispatch however many workers find it alone; a room whose call ended on purpose, a room of another
agent and a caller still within the first dispatch's time get none; a job's end unmarks only its own mark.
The real server is tests/test_livekit_fleet.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest
from livekit import api

from agent import fleet
from agent.settings import AgentSettings

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture(scope="module")
def redis_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            break
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


class FakeLiveKit:
    """LiveKit's room and dispatch API as the watch uses it (`call(method, request)`): rooms with their
    participants and dispatches, and the dispatches created."""

    def __init__(self) -> None:
        self.rooms: dict[str, tuple[api.Room, list[api.ParticipantInfo], list[api.AgentDispatch]]] = {}
        self.created: list[api.CreateAgentDispatchRequest] = []
        self.api = SimpleNamespace(
            room=SimpleNamespace(list_rooms=self.list_rooms, list_participants=self.list_participants),
            agent_dispatch=SimpleNamespace(
                create_dispatch=self.create_dispatch, list_dispatch=self.list_dispatch
            ),
        )

    def add(self, name: str, agent: str, *, caller_joined: float, meta: str = "{}") -> api.Room:
        # as the server lists a room for seconds after its participants changed: its count lags
        room = api.Room(sid=f"RM_{name}", name=name, num_participants=0)
        caller = api.ParticipantInfo(
            identity="caller",
            kind=api.ParticipantInfo.Kind.STANDARD,
            state=api.ParticipantInfo.State.ACTIVE,
            joined_at=int(caller_joined),
        )
        dispatch = api.AgentDispatch(agent_name=agent, room=name, metadata=meta)
        self.rooms[name] = (room, [caller], [dispatch])
        return room

    async def call(self, method, *args):
        return await method(*args)

    async def list_rooms(self, _req):
        return api.ListRoomsResponse(rooms=[r for r, _, _ in self.rooms.values()])

    async def list_participants(self, req):
        return api.ListParticipantsResponse(participants=self.rooms[req.room][1])

    async def list_dispatch(self, room):
        return list(self.rooms[room][2])

    async def create_dispatch(self, req):
        self.created.append(req)
        return api.AgentDispatch(agent_name=req.agent_name, room=req.room, metadata=req.metadata)


def test_a_room_whose_agent_was_lost_gets_one_new_agent_however_many_workers_watch(redis_url, monkeypatch):
    monkeypatch.setattr(fleet, "LIVE_MS", 300)
    lk = FakeLiveKit()
    now = time.time()
    room = lk.add("lobby", "desk", caller_joined=now - 60, meta=json.dumps({"script": "greet"}))
    other = lk.add("elsewhere", "another-agent", caller_joined=now - 60)

    async def main():
        a, b = (fleet.Fleet(fleet.redis_client(redis_url), "desk", w) for w in ("w-a", "w-b"))
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
    assert fleet.redispatched(lk.created[0].metadata) == meta
    assert other.name not in [d.room for d in lk.created]  # another agent's room is not ours


def test_a_caller_still_within_the_first_dispatchs_time_is_left_to_it_and_then_gets_an_agent(redis_url):
    lk = FakeLiveKit()
    clock = [1000.0]
    room = lk.add("new-room", "desk", caller_joined=1000.0)

    async def main():
        f = fleet.Fleet(fleet.redis_client(redis_url), "desk", "w-a", clock=lambda: clock[0])
        early = await f.sweep(lk)
        clock[0] += fleet.FIRST_AGENT_S
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
        f = fleet.Fleet(fleet.redis_client(redis_url), "desk", "w-a")
        keys = fleet.Keys("desk")
        await f.beat([(room.sid, "AJ_old")])
        await f.redis.set(keys.live(room.sid), "w-b AJ_new")  # a newer job (another worker's) marked it since
        await f.beat([])  # the old job ended here: the newer job's mark stays
        kept = await f.redis.get(keys.live(room.sid))
        await f.redis.delete(keys.live(room.sid))
        await fleet.release_room(settings, room.sid)  # the newer job's call ended on purpose
        asked = await f.sweep(lk)
        await f.redis.aclose()
        return kept, asked

    kept, asked = asyncio.run(main())
    assert kept == b"w-b AJ_new"
    assert asked == 0 and not lk.created


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
            "import sys, time; from agent import fleet; import redis;"
            "name = fleet.presence_name('desk', 'w-a');"
            "r = redis.Redis.from_url('redis://' + sys.argv[1], client_name=name);"
            "r.ping(); r.set(fleet.Keys('desk').live('RM_annex'), 'w-a AJ_1', px=60000);"
            "r.set(fleet.Keys('desk').served('RM_annex'), 'AJ_1'); print('up', flush=True); time.sleep(600)",
            redis_url,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def main():
        watcher = fleet.Fleet(
            fleet.redis_client(redis_url),
            "desk",
            "w-b",
            presence=fleet.redis_client(redis_url, name=fleet.presence_name("desk", "w-b")),
        )
        await watcher.beat([])
        live = fleet.Fleet(
            fleet.redis_client(redis_url),
            "desk",
            "w-c",
            presence=fleet.redis_client(redis_url, name=fleet.presence_name("desk", "w-c")),
        )
        await live.beat([(other.sid, "AJ_2")])
        first = [await watcher.sweep(lk)]  # the other worker is there: its room is live
        await asyncio.sleep(fleet.GONE_S + 0.05)
        first.append(await watcher.sweep(lk))
        # a worker reconnecting: its connection missing at one sweep, back before the next
        await live.presence.aclose()
        first.append(await watcher.sweep(lk))
        await live.beat([(other.sid, "AJ_2")])  # its beat opens it again
        await asyncio.sleep(fleet.GONE_S + 0.05)
        first.append(await watcher.sweep(lk))
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        t0 = time.monotonic()
        asked = 0
        while not asked and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
            asked = await watcher.sweep(lk)
        took = time.monotonic() - t0
        mark = await watcher.redis.pttl(fleet.Keys("desk").live(room.sid))
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
