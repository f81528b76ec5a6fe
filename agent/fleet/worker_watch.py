"""The worker's watch over the fleet (agent/fleet/fleet.py), one task of the worker's while it runs: its rooms
marked every BEAT_S until it drains and, apart, the rooms alone looked for every SWEEP_S, the counts of new
agents handed to the engine's snapshot and the rooms whose call ended with no agent in them to the worker
(their conversations), through two connections to the cluster's Redis (one of them the worker's presence) and
LiveKit's API. A failure of either is logged once while it lasts and tried again. Knows Redis, LiveKit's API
and the worker's callbacks; nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from agent.fleet import timing
from agent.fleet.fleet import Fleet
from agent.fleet.marks import _redis_errors, fleet_redis, presence_name
from agent.lkapi import LiveKitFailure

if TYPE_CHECKING:
    from agent.lkapi import LiveKit
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.fleet")


async def watch(
    settings: AgentSettings,
    worker: str,
    jobs: Callable[[], list[tuple[str, str]]],
    report: Callable[[dict[str, int]], None] | None = None,
    handing_over: Callable[[], bool] = lambda: False,
    over: Callable[[list[str]], None] | None = None,
    livekit: Callable[[AgentSettings], LiveKit] | None = None,
) -> None:
    """The worker's watch, until cancelled: its rooms marked every BEAT_S (`jobs()`: its running jobs'
    (room sid, job id)) until `handing_over()` (the worker drains), rooms alone looked for every SWEEP_S, the
    counts of new agents handed to `report` (in a thread: the engine's snapshot) whenever they change, and
    the rooms whose call ended while they had no agent to `over` (in a thread: their conversations). The
    marks and the sweep run apart: a sweep waits on LiveKit's API (seconds, on a busy server), and the marks
    must not lapse meanwhile, or other workers take this worker's rooms for alone. A failure of Redis or of
    LiveKit's API is logged (once while it lasts) and tried again. `livekit`: the API's client (LiveKit)."""
    from agent.lkapi import LiveKit

    presence = fleet_redis(settings, name=presence_name(settings.agent_name, worker))
    fleet = Fleet(fleet_redis(settings), settings.agent_name, worker, presence=presence)

    async def beat() -> None:
        fleet.handing_over = handing_over()
        await fleet.beat(jobs())

    async def sweep(lk: LiveKit) -> None:
        if fleet.handing_over:  # its rooms are others' now
            return
        if await fleet.sweep(lk) and report is not None:
            await asyncio.to_thread(report, dict(fleet.counts))
        if fleet.over:
            log.info("%d calls ended while their agent was lost", len(fleet.over))
            if over is not None:
                await asyncio.to_thread(over, fleet.over)

    try:
        async with (livekit or LiveKit)(settings) as lk:
            beats = _every(timing.BEAT_S, beat, "marks")
            await asyncio.gather(beats, _every(timing.SWEEP_S, lambda: sweep(lk), "sweep"))
    finally:
        await fleet.redis.aclose()
        await presence.aclose()


async def _every(period_s: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """`step()` every `period_s` after the last one ended, until cancelled; a failure is logged once while it
    lasts (a defect with its stack) and the step tried again."""
    failing = False
    while True:
        try:
            await step()
            if failing:
                log.info("the fleet's watch (%s) works again", what)
            failing = False
        except (LiveKitFailure, OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
            if not failing:
                log.warning("the fleet's watch (%s) failed (%s); trying again", what, type(e).__name__)
            failing = True
        except Exception:  # a defect: logged with its stack, and the watch goes on
            log.exception("the fleet's watch (%s) failed", what)
            failing = True
        await asyncio.sleep(period_s)
