"""The conversation the engine benchmarks and the engine tests open: a hotel concierge's prompt and one tool,
`check_availability`, whose free-text `note` lets a forced call be padded to any length. Plain data: knows
the engine's tool-schema form, nothing of sessions or LiveKit.
"""

from __future__ import annotations

TOOLS = [
    {
        "name": "check_availability",
        "description": "Rooms free on given dates.",
        "parameters": {
            "type": "object",
            "properties": {
                "guests": {"type": "integer", "description": "Guests"},
                "note": {"type": "string", "description": "Free text"},
            },
        },
    },
]
PROMPT = "You are the concierge of a small hotel."
