"""The caller's agent: a web caller's `HotelAgent`, or for a phone caller (a SIP participant) the
`PhoneConcierge` with its `PhoneLine` (agent/phone/phone.py), told why the hotel placed the call when it did
(`call_purpose`, from the job's metadata). Knows the agents and the job's metadata; nothing of LiveKit's rooms
or the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from livekit.agents import Agent

    from agent.phone.phone import PhoneLine
    from agent.settings import AgentSettings


def concierge_for(
    settings: AgentSettings,
    hotel: Any,
    *,
    phone: bool,
    room: str,
    identity: str,
    attributes: dict[str, str],
    job_id: str,
    job_metadata: str | None = None,
) -> tuple[Agent, PhoneLine | None]:
    """The caller's agent: a web caller's `HotelAgent`, or for a phone caller (a SIP participant) the
    `PhoneConcierge` with its `PhoneLine` (transfer, hang-up, their number for bookings)."""
    from agent.hotel import HotelAgent
    from agent.phone.phone import PHONE_NUMBER_ATTRIBUTE, PhoneConcierge, PhoneLine

    if not phone:
        return HotelAgent(hotel, session_key=job_id), None
    line = PhoneLine(settings, room=room, identity=identity, number=attributes.get(PHONE_NUMBER_ATTRIBUTE))
    return PhoneConcierge(hotel, line, purpose=call_purpose(job_metadata), session_key=job_id), line


def call_purpose(metadata: str | None) -> str:
    """Why the hotel placed this call: the `reason` that `python -m agent sip call` put in the job's metadata
    ("" for an incoming call, or metadata that is not ours)."""
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        return ""
    reason = meta.get("reason") if isinstance(meta, dict) else None
    return reason.strip()[:500] if isinstance(reason, str) else ""
