"""A room's job's part in the fleet (agent/fleet/fleet.py), in the room's process: before it serves, whether
another job holds its room (`holder`), or the room is taken from a job with no agent in it (`take_room`);
whether its dispatch replaces a lost agent (`redispatched`), and the agents left in the room from before
removed (`remove_stale_agents`); the watch on its own connection to the room (`watch_link`), which marks the
room down while that connection is lost and leaves a room another job holds; and the room released when its
call ends on purpose (`release_room`). Knows LiveKit's room API, an rtc room's connection state and the
fleet's marks in Redis; nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from livekit import api

from agent.fleet import timing
from agent.fleet.agreed import job_in_room, room_name
from agent.fleet.marks import _UNMARK, Keys, _job, _owner, _redis_errors, _text, fleet_redis, present_workers
from agent.fleet.state import REDISPATCH_KEY

if TYPE_CHECKING:
    from livekit import rtc
    from redis.asyncio import Redis

    from agent.lkapi import LiveKit
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.fleet")


async def remove_stale_agents(lk: LiveKit, room: str, own_identity: str) -> int:
    """A new agent's job, dispatched for a room whose agent was lost: remove the other agents of the room
    (a dead worker's stays for about 20 s, until the server drops it), so no two answer the caller; how
    many were removed."""
    people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room))
    stale = [
        p.identity
        for p in people.participants
        if p.kind == api.ParticipantInfo.Kind.AGENT and p.identity != own_identity
    ]
    for identity in stale:
        await lk.call(
            lk.api.room.remove_participant, api.RoomParticipantIdentity(room=room, identity=identity)
        )
    return len(stale)


async def release_room(settings: AgentSettings, sid: str) -> None:
    """A call ended on purpose (its caller left or was said goodbye to, transferred, hung up): its room is
    no longer the fleet's to keep served, so a caller still in it is not given a new agent. Best effort."""
    if not settings.redis_url:
        return
    keys = Keys(settings.agent_name)
    client = fleet_redis(settings)
    try:
        async with client.pipeline(transaction=True) as p:
            p.set(keys.ended(sid), "1", ex=timing.SERVED_S)
            p.delete(keys.served(sid), keys.live(sid))
            await p.execute()
    except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
        log.info("the room's mark could not be removed (%s)", type(e).__name__)
    finally:
        await client.aclose()


async def room_gone(settings: AgentSettings, name: str, sid: str, within_s: float | None = None) -> bool:
    """Whether the server no longer holds the room `sid` (named `name`): everyone left it, or it was deleted.
    A room the server is closing is still listed for a moment after its participants were let go: asked again
    until `within_s` has passed. False when it is still listed then, or the server could not be asked (its
    node lost: the room may be made again on another)."""
    from agent.lkapi import LiveKit, LiveKitFailure

    deadline = time.monotonic() + (timing.GONE_WAIT_S if within_s is None else within_s)
    try:
        async with LiveKit(settings) as lk:
            while True:
                found = await lk.call(lk.api.room.list_rooms, api.ListRoomsRequest(names=[name]))
                if all(r.sid != sid for r in found.rooms):
                    return True
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(timing.GONE_POLL_S)
    except LiveKitFailure as e:
        log.info("whether the room is gone is not known (%s)", e)
        return False


def redispatched(metadata: str | None) -> dict[str, Any] | None:
    """What a job's dispatch metadata says of a new agent for a lost one (None: the room's first)."""
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        return None
    if isinstance(meta, dict) and meta.get(REDISPATCH_KEY):
        return meta
    return None


async def holder(settings: AgentSettings, sid: str, job: str) -> str | None:
    """A new job's look at its room before it serves: the other job that holds the room (a live mark that
    names another job, whose connection is not down, of a worker whose presence connection Redis lists), or
    None when this job is the room's agent. Redis unreachable: None (a caller is better served twice for a
    moment than not at all; the new agent removes the room's others)."""
    if not settings.redis_url:
        return None
    client = fleet_redis(settings)
    try:
        return await _held_by(client, settings, sid, job)
    except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
        log.info("the room's holder could not be read (%s)", type(e).__name__)
        return None
    finally:
        await client.aclose()


async def take_room(settings: AgentSettings, sid: str, other: str) -> None:
    """A new job in a room whose holder (`other`, up as far as its job knows) has no agent in it (the room was
    made again on another node without it): that job is taken as down, so this job's worker marks the room
    and the other job leaves when its connection is back. Best effort."""
    client = fleet_redis(settings)
    try:
        await client.set(Keys(settings.agent_name).down(sid), other, px=timing.MOVED_DOWN_MS)
    except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
        log.info("the room could not be taken over (%s)", type(e).__name__)
    finally:
        await client.aclose()


async def _held_by(
    client: Redis, settings: AgentSettings, sid: str, job: str, room: str | None = None
) -> str | None:
    keys = Keys(settings.agent_name)
    async with client.pipeline(transaction=False) as p:
        p.get(keys.live(sid))
        p.get(keys.down(sid))
        mark, down = await p.execute()
    other, worker = _job(mark), _owner(mark)
    if other is None or other == job or other == _text(down) or worker is None:
        return None
    try:
        present = await present_workers(client, settings.agent_name, {worker})
    except _redis_errors():  # Redis gone meanwhile: the mark alone tells
        present = None
    if present is not None and worker not in present:
        return None
    if await _agrees(settings, sid, other, room):
        return other
    # a mark LiveKit does not agree with (written by hand, say): removed, so this job's worker marks the room
    if sid not in _doubted:  # once per room: whoever wrote it may write it again
        _doubted.add(sid)
        log.warning("job %s: the room's live mark names job %s, not in it as LiveKit sees it", job, other)
    with contextlib.suppress(_redis_errors()):
        await client.eval(_UNMARK, 1, keys.live(sid), mark)
    return None


_doubted: set[str] = set()  # rooms (sid) whose live mark LiveKit did not agree with, said once


def _livekit(settings: AgentSettings) -> LiveKit:
    from agent.lkapi import LiveKit

    return LiveKit(settings)


async def _agrees(settings: AgentSettings, sid: str, other: str, room: str | None) -> bool:
    """Whether LiveKit agrees that job `other` serves the room `sid` (named `room`, if known): its agent is in
    the room, or the server started it within JOIN_S (agent/fleet/agreed.py). A server that cannot be asked:
    the mark alone tells."""
    from agent.lkapi import LiveKitFailure

    if settings.missing_livekit():
        return True
    try:
        async with _livekit(settings) as lk:
            name = room or await room_name(lk, sid)
            return name is None or await job_in_room(lk, name, settings.agent_name, other)
    except LiveKitFailure as e:
        log.info("whether LiveKit agrees with the room's mark is not known (%s)", e)
        return True


async def watch_link(
    room: rtc.Room,
    settings: AgentSettings,
    sid: str,
    job: str,
    on_down: Callable[[bool], None],
    on_replaced: Callable[[], None],
    handing_over: Callable[[], bool] = lambda: False,
) -> None:
    """A job's watch on its own connection to its room, until cancelled: down for DOWN_GRACE_S, the room is
    marked down (the fleet finds it alone and dispatches another agent) and `on_down(True)`. Connected again
    (however briefly it was down: the SDK's `reconnected`), its down mark (its own, or the fleet's for a room
    made again without it) is removed and the room looked at: held by another job that is up, `on_replaced()`
    and the watch ends; else `on_down(False)`. While up, every HELD_S, the same look (two jobs dispatched to
    one room: the one marked first keeps it), except while `handing_over()` (its worker drains: the new agent
    removes this one once its own session is live). The state is polled every BEAT_S. A failure of Redis is
    logged once and tried again. Cancelled (the job ends) while its connection is down, it leaves the room
    marked down for ENDED_DOWN_MS: its worker lists the job until its process has exited."""
    from livekit import rtc

    up = rtc.ConnectionState.CONN_CONNECTED
    name = getattr(room, "name", None)  # (LiveKit is asked whether it agrees with another job's mark)
    keys = Keys(settings.agent_name)
    client = fleet_redis(settings)
    back = asyncio.Event()
    room.on("reconnected", back.set)
    since: float | None = None  # when the connection went down
    marked = failing = came_back = False
    next_look = time.monotonic() + timing.HELD_S
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(back.wait(), timing.BEAT_S)
            came_back = came_back or back.is_set()  # (kept until read: Redis may fail this time)
            back.clear()
            try:
                if room.connection_state != up:
                    since = since if since is not None else time.monotonic()
                    if time.monotonic() - since >= timing.DOWN_GRACE_S:
                        await client.set(keys.down(sid), job, px=timing.LIVE_MS)
                        if not marked:
                            log.warning("job %s: its room connection is down; the fleet steps in", job)
                            on_down(True)
                        marked = True
                elif since is not None or came_back:
                    await client.eval(_UNMARK, 1, keys.down(sid), job)  # its own, or the fleet's for it
                    if await _held_by(client, settings, sid, job, name) is not None:
                        log.warning("job %s: back in its room, now another agent's; it leaves", job)
                        on_replaced()
                        return
                    if marked:
                        log.info("job %s: its room connection is back", job)
                        on_down(False)
                    since, marked, came_back = None, False, False
                elif time.monotonic() >= next_look and not handing_over():
                    next_look = time.monotonic() + timing.HELD_S
                    if (other := await _held_by(client, settings, sid, job, name)) is not None:
                        log.warning("job %s: the room is job %s's, there first; it leaves", job, other)
                        on_replaced()
                        return
                failing = False
            except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
                if not failing:
                    log.warning("job %s: the link's mark failed (%s); trying again", job, type(e).__name__)
                failing = True
    finally:
        room.off("reconnected", back.set)
        if room.connection_state != up:
            # the job ends with its connection down: its worker lists it (and marks the room live) until its
            # process has exited, so its down mark stands past that, and the fleet finds the room alone
            with contextlib.suppress(OSError, ConnectionError, TimeoutError, _redis_errors()):
                await client.set(keys.down(sid), job, px=timing.ENDED_DOWN_MS)
        await client.aclose()
