"""A room's job for tests/test_room_process_log.py, run by livekit-agents' process executor in a process of
its own: it sets up its log as a room's job does (agent/room.py `run_job`) and writes the lines a SIP call's
job writes (the framework's, with the room's and caller's names as fields, and Chorus's own), then ends."""

from __future__ import annotations

import logging

from livekit.agents import JobContext, JobProcess

from agent.log_privacy import CALLER_DATA_MASK, mask_log_handlers

CALLER = "sip_+14155550123"


def prewarm(proc: JobProcess) -> None:
    logging.getLogger("chorus.test").info("room process ready")


async def entrypoint(ctx: JobContext) -> None:
    from livekit.agents.log import logger

    mask_log_handlers()
    CALLER_DATA_MASK.learn(ctx.job.room.name, CALLER)
    logger.info(
        "participant joined",
        extra={
            "lk.pii.room_name": ctx.job.room.name,
            "lk.pii.participant_identity": CALLER,
            "participant": CALLER,
        },
    )
    logging.getLogger("chorus.agent.room").info("call in %s answered", ctx.job.room.name)
    logging.getLogger("chorus.test").info("job done")
    ctx.shutdown("done")
