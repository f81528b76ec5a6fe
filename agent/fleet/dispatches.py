"""A room's dispatches of one agent, as LiveKit's dispatch API lists them: the metadata the last one carried
(a phone call's purpose, a test's script), for a new dispatch of the same agent to carry too
(agent/fleet/fleet.py). Knows LiveKit's dispatch API; nothing of Redis, the engine or the call.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.lkapi import LiveKit


async def last_metadata(lk: LiveKit, room: str, agent_name: str) -> dict[str, Any]:
    """The metadata the room's last dispatch of `agent_name` carried: a JSON object's fields, or anything
    else under `metadata`; {} when the room has none of that agent."""
    found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
    mine = [d for d in found if d.agent_name == agent_name]
    if not mine:
        return {}
    last = max(mine, key=lambda d: d.state.created_at)
    try:
        meta = json.loads(last.metadata or "{}")
    except ValueError:
        meta = None
    return meta if isinstance(meta, dict) else {"metadata": last.metadata}
