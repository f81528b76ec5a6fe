"""A room's job that takes a call over from another agent: the agents left in the room from before are
removed, so no two answer the caller (`_replace_lost_agent`); a call handed over by a draining worker starts
its session once the caller has taken this agent's track (`_heard_first`), and has its old agent removed once
the session sends its first frame (`_take_over`); and a call carried on after its agent was lost has the
caller hear the hold clip while the new session's prompt, which holds the earlier conversation, is prefilled
(`_hold_on`). Knows the call's session and its output (agent/call.py), the call's track
(agent/audio_out/sinks.py) and LiveKit's room API; nothing of Redis or the engine's internals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from agent.fleet import timing
from agent.fleet.room_job import remove_stale_agents

if TYPE_CHECKING:
    from collections.abc import Collection

    from livekit.agents import JobContext

    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.room")


async def _heard_first(ctx: JobContext, sink, callers: Collection[int]) -> None:
    """A call handed over by a draining worker, before its session starts: this agent's track is published
    and taken by the room's callers (participants of the kinds `callers`; at most TAKE_OVER_S), so that its
    first words, which begin as soon as the session is live, are not spoken into a track the caller cannot
    hear yet (the draining agent talks on)."""
    heard_by = getattr(sink, "heard_by", None)  # the console has no room
    if heard_by is None:
        return
    asked = time.monotonic()
    await sink.join(ctx.room)
    heard = await heard_by(ctx.room, callers, timing.TAKE_OVER_S)
    log.info(
        "job %s: its track %s the room's callers in %.2f s",
        ctx.job.id,
        "taken by" if heard else "not yet taken by",
        time.monotonic() - asked,
    )


async def _take_over(ctx: JobContext, settings: AgentSettings, call) -> None:
    """A call handed over by a draining worker: its agent is removed once this job's session sends its first
    frame (at most TAKE_OVER_S after the session opened), so the caller is not left between the two; one
    removed before that has the caller hear the hold clip until this one speaks."""
    asked = time.monotonic()
    live = await _live_within(call.duplex, timing.TAKE_OVER_S)
    if call.closed:
        return
    if live:
        log.info("job %s: its session live %.2f s after it started", ctx.job.id, time.monotonic() - asked)
    else:
        log.info("job %s: the call taken over before its session is live hears a hold clip", ctx.job.id)
        call.output.hold_on()
    await _replace_lost_agent(ctx, settings)


async def _hold_on(call) -> None:
    """A call carried on after its agent was lost: a session whose first frame is not out HOLD_ON_S after it
    was asked for (its prompt, which holds the earlier conversation, is being prefilled) has the caller hear
    "bear with me" meanwhile."""
    duplex = call.duplex
    await duplex.opened.wait()
    if not await _live_within(duplex, timing.HOLD_ON_S) and duplex.handle is not None and not call.closed:
        log.info("session %s: not live yet, the caller hears a hold clip", duplex.handle.id)
        call.output.hold_on()


async def _live_within(duplex, timeout: float) -> bool:
    """Whether the session sends its first frame within `timeout` seconds."""
    try:
        await asyncio.wait_for(duplex.first_frame.wait(), timeout)
    except TimeoutError:
        return False
    return True


async def _replace_lost_agent(ctx: JobContext, settings: AgentSettings) -> None:
    """This job's agent replaces one the room lost (agent/fleet/fleet.py): the agents left in the room from
    before (a dead worker's stays until the server drops it) are removed, so no two answer the caller."""
    from agent.lkapi import LiveKit, LiveKitFailure

    try:
        async with LiveKit(settings) as lk:
            n = await remove_stale_agents(lk, ctx.job.room.name, ctx.room.local_participant.identity)
    except LiveKitFailure as e:
        log.warning("job %s: the room's earlier agents could not be removed (%s)", ctx.job.id, e)
        return
    log.info("job %s: replaces the room's lost agent (%d left from before removed)", ctx.job.id, n)
