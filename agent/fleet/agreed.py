"""The fleet's marks (agent/fleet/fleet.py) believed only where LiveKit agrees: a mark in the cluster's Redis
is anyone's to write who can write there, while only the server puts an agent in a room. A live mark counts
for a job while LiveKit lists that job's agent in the room (`agent-<job id>`, the identity livekit-agents
gives a job's participant), or for JOIN_S after the mark was first seen or the server started the job (its
agent joining); a down mark counts for a job only while LiveKit does not list its agent in the room (in a
room made again on another node, an agent listed from before its callers came back is the dead node's). A room
whose live mark LiveKit does not agree with is served still if an agent of one of the room's jobs (as the
server's dispatches list them) is in it. A sweep's part is agent/fleet/classify.py; here are the looks both it
and a room's job take. Knows LiveKit's room and dispatch API; nothing of Redis, the engine or the call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from livekit import api

from agent.fleet import timing
from agent.fleet.state import PRESENT

if TYPE_CHECKING:
    from collections.abc import Iterable

    from agent.lkapi import LiveKit

AGENT = api.ParticipantInfo.Kind.AGENT


def agent_identity(job: str) -> str:
    """The identity of a job's agent in its room (livekit-agents' `JobRequest.accept`, as Chorus accepts)."""
    return f"agent-{job}"


def agents_in_room(people: Iterable[api.ParticipantInfo], since: int = 0) -> set[str]:
    """The identities of the agents LiveKit lists in the room, joined at `since` or later (a room made again
    on another node: an agent listed from before its callers came back is the dead node's)."""
    return {p.identity for p in people if p.kind == AGENT and p.state in PRESENT and p.joined_at >= since}


async def room_jobs(lk: LiveKit, room: str, agent_name: str) -> dict[str, api.Job]:
    """The jobs the server started for the room's dispatches of `agent_name`, by id."""
    found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
    return {j.id: j for d in found if d.agent_name == agent_name for j in d.state.jobs}


def just_started(job: api.Job, now: float) -> bool:
    """Whether the server started (or assigned) `job` within JOIN_S of `now` (wall time)."""
    started = job.state.started_at or job.state.updated_at  # nanoseconds
    return not started or now - started / 1e9 < timing.JOIN_S


async def job_in_room(lk: LiveKit, room: str, agent_name: str, job: str) -> bool:
    """A job's look at another job whose mark holds its room: whether LiveKit agrees that one serves it (its
    agent in the room, or the server started it within JOIN_S)."""
    people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room))
    if agent_identity(job) in agents_in_room(people.participants):
        return True
    jobs = await room_jobs(lk, room, agent_name)
    return job in jobs and just_started(jobs[job], time.time())


async def room_name(lk: LiveKit, sid: str) -> str | None:
    """The name of the room `sid` (None: the server holds no such room)."""
    rooms = await lk.call(lk.api.room.list_rooms, api.ListRoomsRequest())
    return next((r.name for r in rooms.rooms if r.sid == sid), None)
