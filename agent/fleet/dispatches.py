"""A room's dispatches of one agent, as LiveKit's dispatch API lists them, and the one way Chorus asks for a
new agent in a room (`ask_for_agent`): the fleet's sweep for a room alone (agent/fleet/fleet.py), and a job
whose room connection was lost when no Redis is set (`redispatch_lost`). A new dispatch carries what the
room's last one did (a phone call's purpose, a test's script), how often the room's agent was replaced
(REDISPATCH_KEY) and why (REASON_KEY).

A dispatch whose call failed without an answer (a timeout on a busy server) may have been made all the same:
its outcome is unknown, and it counts as made until the room's dispatch list says otherwise, so a room is not
sent a second agent for one the server did create. Knows LiveKit's dispatch API; nothing of Redis, the engine
or the call.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from typing import TYPE_CHECKING, Any

from livekit import api

from agent.fleet import timing
from agent.fleet.state import REASON_KEY, REDISPATCH_KEY, Reason, callers
from agent.lkapi import LiveKitFailure

if TYPE_CHECKING:
    from agent.lkapi import LiveKit

log = logging.getLogger("chorus.agent.fleet")


class Asked(enum.Enum):
    """How a new dispatch asked for came out (one that was not made raises LiveKitFailure)."""

    MADE = "made"
    LISTED = "made, its call failed"  # the call failed, and the room's dispatch list shows it
    UNKNOWN = "not known"  # the call failed, and the dispatch list could not be read: counts as made


def metadata_of(text: str | None) -> dict[str, Any]:
    """A dispatch's metadata as a dict: a JSON object's fields, or anything else under `metadata`."""
    try:
        meta = json.loads(text or "{}")
    except ValueError:
        meta = None
    return meta if isinstance(meta, dict) else {"metadata": text}


async def last_metadata(lk: LiveKit, room: str, agent_name: str) -> dict[str, Any]:
    """The metadata the room's last dispatch of `agent_name` carried; {} when the room has none of that
    agent."""
    found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
    mine = [d for d in found if d.agent_name == agent_name]
    if not mine:
        return {}
    return metadata_of(max(mine, key=lambda d: d.state.created_at).metadata)


async def ask_for_agent(
    lk: LiveKit, agent_name: str, room: str, meta: dict[str, Any], times: int, reason: Reason
) -> Asked:
    """Ask the server for a new dispatch of `agent_name` in `room`, its `times`th, carrying `meta` and why
    (`reason`). A call that fails is checked against the room's dispatch list: one listed (with these
    `times`) was made; the list unreadable, the outcome is unknown and counts as made; not listed, the
    call's LiveKitFailure is raised."""
    meta = {**meta, REDISPATCH_KEY: times, REASON_KEY: reason.value}
    request = api.CreateAgentDispatchRequest(agent_name=agent_name, room=room, metadata=json.dumps(meta))
    try:
        await lk.call(lk.api.agent_dispatch.create_dispatch, request)
        return Asked.MADE
    except LiveKitFailure as e:
        if e.error is not None and e.error.status < 500:  # the server's own answer: refused, not made
            raise
        failed = e
    try:
        found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
    except LiveKitFailure:
        return Asked.UNKNOWN
    mine = (metadata_of(d.metadata) for d in found if d.agent_name == agent_name)
    if any(m.get(REDISPATCH_KEY) == times for m in mine):
        return Asked.LISTED
    raise failed


async def redispatch_lost(lk: LiveKit, agent_name: str, room: str, metadata: str | None) -> bool:
    """A job whose room connection was lost (the rtc SDK gave up on it, as it can on a starved machine right
    after joining), with no fleet to see its room alone: while a caller is still in the room, a new dispatch
    of its agent there, at most REDISPATCH_MAX times per room (counted in the job's `metadata`). Whether one
    was asked for; LiveKitFailure if the server could not be asked."""
    meta = metadata_of(metadata)
    count = int(meta.get(REDISPATCH_KEY, 0) or 0)
    if count >= timing.REDISPATCH_MAX:
        return False
    for look in range(timing.REDISPATCH_LOOKS):  # a caller dropped with the agent may be rejoining
        if look:
            await asyncio.sleep(timing.REDISPATCH_LOOK_S)
        people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room))
        if callers(people.participants):
            break
    else:
        log.info("the room's connection was lost and no caller is left in it")
        return False
    await ask_for_agent(lk, agent_name, room, meta, count + 1, Reason.AGENT_LOST)
    return True
