"""Draining a worker (SIGTERM, or `AgentServer.drain`): no new jobs, and every call in progress ends properly.

livekit-agents stops taking jobs and waits up to the drain timeout for the jobs in progress, then cuts them
off. Chorus lets a call go on while there is time, and ends one still going GOODBYE_LEAD_S before that
deadline with the agent saying goodbye in its own voice (the words forced on the model's text channel, which
the talker speaks as it speaks any turn), then hangs up. So no caller is cut off mid-sentence by a deploy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from livekit.agents import AgentServer
from livekit.agents.types import NOT_GIVEN, NotGivenOr

from agent.draining import DRAIN as DRAIN  # (the process's drain, agent/draining.py)

if TYPE_CHECKING:
    from agent.call import Call
    from engine.api import EngineClient

log = logging.getLogger("chorus.agent.drain")

GOODBYE = " I'm sorry, this line is closing for maintenance. Please call us again in a minute. Goodbye."
GOODBYE_LEAD_S = 10.0  # a call still going this long before the drain's deadline is ended with a goodbye
GOODBYE_WAIT_S = 8.0  # the goodbye's turn is given this long to play before the call is hung up


class DrainingServer(AgentServer):
    """The AgentServer whose drain tells the calls in progress how long they have."""

    def __init__(self, *args: Any, drain_timeout: int, **kwargs: Any) -> None:
        super().__init__(*args, drain_timeout=drain_timeout, **kwargs)
        self.drain_s = float(drain_timeout)

    async def drain(self, timeout: NotGivenOr[int | None] = NOT_GIVEN) -> None:
        DRAIN.begin(float(timeout) if isinstance(timeout, int | float) and timeout else self.drain_s)
        await super().drain(timeout)


async def goodbye_on_drain(
    call: Call,
    engine: EngineClient,
    hang_up: Callable[[], Awaitable[None]],
    before: Callable[[], None] | None = None,
) -> None:
    """Run beside a call: once the worker drains and the deadline is GOODBYE_LEAD_S away, the agent says
    goodbye (after `before`, which stops anything else forcing the model), and when that turn has played
    `hang_up` ends the call. Returns at once if the call ends first."""
    while not DRAIN.started.is_set():
        if call.closed:
            return
        await asyncio.sleep(0.25)
    while time.monotonic() < DRAIN.deadline - GOODBYE_LEAD_S:
        if call.closed:
            return
        await asyncio.sleep(0.25)
    handle = call.handle
    if call.closed or handle is None or handle.closed:
        return
    if before is not None:
        before()
    tok = engine.tokens
    handle.force_text([tok.bos, *tok.encode(GOODBYE), tok.eos])
    played = await call.output.after_next_turn(GOODBYE_WAIT_S)
    log.info("draining: a call ended with a goodbye%s", "" if played else " (not played in time)")
    await hang_up()
