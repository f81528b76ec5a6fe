"""The worker's watch over the fleet (agent/fleet/fleet.py), one task of the worker's while it runs: its rooms
marked every BEAT_S until it drains, the rooms alone looked for every SWEEP_S, the counts of new agents handed
to the engine's snapshot and the rooms whose call ended with no agent in them to the worker (their
conversations), through two connections to the cluster's Redis (one of them the worker's presence) and
LiveKit's API. A failure of either is logged once while it lasts and tried again. Knows Redis, LiveKit's API
and the worker's callbacks; nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.fleet.fleet import BEAT_S, SWEEP_S, Fleet
from agent.fleet.marks import _redis_errors, presence_name, redis_client
from agent.lkapi import LiveKitFailure

if TYPE_CHECKING:
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.fleet")


async def watch(
    settings: AgentSettings,
    worker: str,
    jobs: Callable[[], list[tuple[str, str]]],
    report: Callable[[dict[str, int]], None] | None = None,
    handing_over: Callable[[], bool] = lambda: False,
    over: Callable[[list[str]], None] | None = None,
) -> None:
    """The worker's watch, until cancelled: its rooms marked every BEAT_S (`jobs()`: its running jobs'
    (room sid, job id)) until `handing_over()` (the worker drains), rooms alone looked for every SWEEP_S, and
    the counts of new agents handed to `report` (in a thread: the engine's snapshot) whenever they change,
    and the rooms whose call ended while they had no agent to `over` (in a thread: their conversations).
    A failure of Redis or of LiveKit's API is logged (once while it lasts) and tried again."""
    from agent.lkapi import LiveKit

    presence = redis_client(settings.redis_url, name=presence_name(settings.agent_name, worker))
    fleet = Fleet(redis_client(settings.redis_url), settings.agent_name, worker, presence=presence)
    failing = False
    next_sweep = 0.0
    try:
        async with LiveKit(settings) as lk:
            while True:
                try:
                    fleet.handing_over = handing_over()
                    await fleet.beat(jobs())
                    if time.monotonic() >= next_sweep and not fleet.handing_over:  # its rooms are others'
                        next_sweep = time.monotonic() + SWEEP_S
                        if await fleet.sweep(lk) and report is not None:
                            await asyncio.to_thread(report, dict(fleet.counts))
                        if fleet.over:
                            log.info("%d calls ended while their agent was lost", len(fleet.over))
                            if over is not None:
                                await asyncio.to_thread(over, fleet.over)
                    if failing:
                        log.info("the fleet's watch works again")
                    failing = False
                except (LiveKitFailure, OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
                    if not failing:
                        log.warning("the fleet's watch failed (%s); trying again", type(e).__name__)
                    failing = True
                except Exception:  # a defect: logged with its stack, and the watch goes on
                    log.exception("the fleet's watch failed")
                    failing = True
                await asyncio.sleep(BEAT_S)
    finally:
        await fleet.redis.aclose()
        await presence.aclose()
