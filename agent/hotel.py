"""The hotel concierge: a livekit-agents `Agent` whose five function tools call `tools/`.

`Concierge` holds what every caller's agent shares (the tool runner and the tools common to all);
`HotelAgent` is a web caller's concierge, and agent/phone/phone.py's `PhoneConcierge` a phone caller's.
The only module that joins the hotel to LiveKit. The tools' JSON schemas come from `tools.schemas`
(one source of truth), so each `@function_tool` takes the model's raw arguments and `tools/` validates
them with messages the model can speak. Domain failures become `ToolError`s; the store is synchronous,
so every call runs in a worker thread and never blocks the room's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from livekit.agents import Agent, RunContext, ToolError, function_tool

from prompts import load_prompt
from tools import schemas
from tools.errors import HotelError, NotFound
from tools.hotel import Hotel
from tools.replies import ResultWriter
from tools.rules import spoken_date

log = logging.getLogger(__name__)

# A confirmation code has ~36 bits; this many misses in one call ends lookups for that call.
MAX_FAILED_LOOKUPS = 5
_LOOKUPS = ("find_reservation", "change_or_cancel_reservation", "manage_reservation")
TOO_MANY_LOOKUPS = (
    "I can't look up any more reservations on this call; the front desk can help you with that reservation."
)
SYSTEM_TROUBLE = (
    "The reservation system has a problem right now; offer to transfer the caller to the front desk."
)


def concierge_instructions(hotel: Hotel) -> str:
    """The concierge system prompt for this hotel and today's date (reads the hotel's name once)."""
    policy = hotel.policy()
    today = hotel.today()
    return load_prompt("concierge", hotel_name=policy.name, today=spoken_date(today))


RESULTS = ResultWriter()  # this process's tools' answers as the model reads them (counted: `RESULTS.stats()`)


def hotel_tool(name: str):
    """The hotel's tool `name` as a concierge's function tool: the model's raw arguments, its schema from
    tools.schemas, answered by `Concierge._call`."""

    async def tool(self: Concierge, raw_arguments: dict[str, object], context: RunContext) -> str:
        return await self._call(name, raw_arguments, context)

    tool.__name__ = tool.__qualname__ = name
    return function_tool(tool, raw_schema=schemas.tool_schema(name))


class Concierge(Agent):
    """One caller's concierge: the tools every caller has, and the runner of all hotel tools. `session_key`
    scopes booking idempotency to this conversation: the same booking asked twice (a retried call, a
    repeated tool call) is made once."""

    def __init__(
        self, hotel: Hotel, *, instructions: str | None = None, session_key: str | None = None
    ) -> None:
        self._hotel = hotel
        self._session_key = session_key or uuid.uuid4().hex
        self._failed_lookups = 0
        super().__init__(
            instructions=instructions if instructions is not None else concierge_instructions(hotel)
        )

    async def _call(self, name: str, arguments: Any, context: RunContext | None) -> str:
        call_id = context.function_call.call_id if context is not None else "-"
        if name in _LOOKUPS and self._failed_lookups >= MAX_FAILED_LOOKUPS:
            raise ToolError(TOO_MANY_LOOKUPS)
        # the answer is due `deadline_s` after the call reached the agent, time in the thread queue included
        deadline = time.monotonic() + self._hotel.deadline_s
        try:
            result = await asyncio.to_thread(
                self._hotel.call, name, arguments, session=self._session_key, deadline=deadline
            )
            text = RESULTS.text(result)  # one too deep or too large to write is the model's sentence
        except NotFound as exc:
            self._failed_lookups += 1
            raise ToolError(exc.message) from None
        except HotelError as exc:
            log.info("hotel tool %s (call %s): %s", name, call_id, exc.code)
            raise ToolError(exc.message) from None
        except Exception as exc:
            # Type only: messages of database errors can quote guest data.
            log.error("hotel tool %s (call %s) failed: %s", name, call_id, type(exc).__name__)
            log.debug("hotel tool failure", exc_info=True)
            raise ToolError(SYSTEM_TROUBLE) from None
        return text

    check_availability = hotel_tool("check_availability")
    hotel_info = hotel_tool("hotel_info")


class HotelAgent(Concierge):
    """A web caller's concierge: the hotel's five tools (`tools.schemas.WEB_TOOLS`)."""

    book_room = hotel_tool("book_room")
    find_reservation = hotel_tool("find_reservation")
    change_or_cancel_reservation = hotel_tool("change_or_cancel_reservation")


def tool_schemas(agent: Agent) -> list[dict[str, Any]]:
    """The agent's function tools as {name, description, parameters}: what `engine.text.prompt` renders into
    the model's `<AVAILABLE_TOOLS>` block (the same conversion the duplex model applies)."""
    from agent.tool_schemas import tool_schemas as schemas_of

    return schemas_of(list(agent.tools))
