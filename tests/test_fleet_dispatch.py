"""A new dispatch whose outcome is unknown (agent/fleet/dispatches.py): `create_dispatch` timed out on a busy
server, which may have made the dispatch all the same. It counts as made until the room's dispatch list says
otherwise: a room whose dispatch was made under a timeout is not sent a second agent, and one whose list
cannot be read keeps its claim (asked again only once the claim lapses). One the list shows was not made is
asked again at the next sweep (tests/test_fleet.py). Against a real Redis and LiveKit's API as a stand-in.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
from livekit import api

from agent.fleet import fleet, marks
from agent.lkapi import LiveKitFailure
from fleet_support import FakeLiveKit
from fleet_support import fixture as _redis_url  # noqa: F401 (the fixture `redis_url`)

pytestmark = [  # a Redis of its own; the watch's sweeps on the wall clock (serial: tests/conftest.py)
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.serial,
]


def timing_out(lk: FakeLiveKit, *, listable: bool = True) -> None:
    """`lk`'s create_dispatch makes the dispatch (the room's dispatch list shows it) and then times out, as a
    busy server's answer that comes too late; with `listable` False, the dispatch list fails from then on."""

    async def create_dispatch(req: api.CreateAgentDispatchRequest):
        lk.created.append(req)
        lk.rooms[req.room][2].append(
            api.AgentDispatch(agent_name=req.agent_name, room=req.room, metadata=req.metadata)
        )
        if not listable:
            lk.api.agent_dispatch.list_dispatch = unlistable
        raise LiveKitFailure("create_dispatch", "no answer in time")

    async def unlistable(_room):
        raise LiveKitFailure("list_dispatch", "no answer in time")

    lk.api.agent_dispatch.create_dispatch = create_dispatch


async def sweeps(
    redis_url: str, lk: FakeLiveKit, room: api.Room, n: int
) -> tuple[list[int], dict, bytes | None]:
    """`n` sweeps of one worker over `room` (served, its agent lost): what each asked for, the worker's counts
    and the room's count of new agents."""
    f = fleet.Fleet(marks.redis_client(redis_url), "desk", "w-a")
    keys = marks.Keys("desk")
    await f.redis.delete(keys.claim(room.sid), keys.count(room.sid))
    await f.redis.set(keys.served(room.sid), "AJ_gone")
    asked = [await f.sweep(lk) for _ in range(n)]
    times = await f.redis.get(keys.count(room.sid))
    await f.redis.aclose()
    return asked, dict(f.counts), times


def test_a_dispatch_made_under_a_call_that_timed_out_is_not_asked_for_twice(redis_url):
    lk = FakeLiveKit()
    room = lk.add("ballroom", "desk", caller_joined=time.time() - 60)
    timing_out(lk)
    asked, counts, times = asyncio.run(sweeps(redis_url, lk, room, 3))
    assert [d.room for d in lk.created] == [room.name]  # one new agent, though the sweeps went on
    assert asked == [1, 0, 0] and counts["agent lost"] == 1 and times == b"1"
    assert json.loads(lk.created[0].metadata)[fleet.REDISPATCH_KEY] == 1


def test_a_dispatch_whose_outcome_cannot_be_read_counts_as_made_while_its_claim_lasts(redis_url):
    lk = FakeLiveKit()
    room = lk.add("terrace", "desk", caller_joined=time.time() - 60)
    timing_out(lk, listable=False)
    asked, counts, times = asyncio.run(sweeps(redis_url, lk, room, 3))
    assert [d.room for d in lk.created] == [room.name]
    assert asked == [1, 0, 0] and counts["agent lost"] == 1 and times == b"1"
