"""A session's phase in the tick, and how many of its turn's text pieces it keeps: what the tick
(engine/tick/session.py) sets and the snapshot (engine/observe/snapshot.py) reads, below both so that neither
imports the other for them.
"""

from __future__ import annotations

import enum

SAID_PIECES = 64  # text pieces of the agent's current (or last) turn kept for the snapshot's `last_words`


class Phase(enum.Enum):
    """A session's phase in the tick (engine/tick/session.py), shown by its value in the snapshot."""

    PROMPT = "prompt"  # system prompt being prefilled (a guaranteed share of every tick, plus the slack)
    LIVE = "live"  # in the live batch: hears 80 ms, says 80 ms per tick
    TOOL_CALL = "tool_call"  # paused; tool-call tokens generated unpaced (guaranteed share + slack)
    WAITING = "waiting"  # paused; function calls emitted, waiting for results
    PREFILL = "prefill"  # paused; results being prefilled in chunks (guaranteed share + slack)
    REPLAY = "replay"  # caller audio that arrived meanwhile fed faster than real time, agent silent; live
    # again by a tick fixed on entry (`Progress.live_by`): held audio that cannot be caught up by
    # then is skipped
