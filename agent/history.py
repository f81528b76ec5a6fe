"""A call's memory stays bounded however long the call lasts.

livekit-agents keeps, for every session, the whole conversation three times over (the session's history,
the agent's chat context, the duplex adapter's copy of what the model has been told) and every event it
emitted (for its session report). A duplex model keeps its own context in the engine, so none of these is
read back to generate anything; on a call that lasts an hour they only grow. `bound_call_memory` keeps the
newest `HISTORY_ITEMS` chat items (instructions and configuration items are always kept) and the newest
`EVENTS_KEPT` events. All three contexts are trimmed at the same moment to the same creation-time cutoff, so
the adapter's diff between them never sees an item removed or re-created.

The contexts and the event record are the framework's own (private) attributes; `bound_call_memory` checks
that they are there and says so when the installed livekit-agents has moved them.
"""

from __future__ import annotations

import logging
from typing import Any

from livekit.agents import AgentSession, llm

log = logging.getLogger("chorus.agent.history")

HISTORY_ITEMS = 64  # chat items a call keeps (the engine has its own context; these are for transcripts)
EVENTS_KEPT = 128  # session events a call keeps (livekit's session report)
_TRIMMED = ("message", "function_call", "function_call_output")


class RecentEvents(list):
    """A list that keeps its newest `keep` entries (trimmed in batches: appending stays O(1) amortised)."""

    def __init__(self, items: list[Any], keep: int) -> None:
        super().__init__(items[-keep:])
        self.keep = keep

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) >= 2 * self.keep:
            del self[: len(self) - self.keep]


def _trimmable(item: llm.ChatItem) -> bool:
    return item.type in _TRIMMED and not (item.type == "message" and item.role in ("system", "developer"))


def trim_contexts(contexts: list[llm.ChatContext], keep: int) -> int:
    """Drops, from every context, the conversational items older than the `keep`-th newest of the first
    context; returns how many were dropped in all."""
    items = [i for i in contexts[0].items if _trimmable(i)]
    if len(items) <= keep:
        return 0
    cutoff = items[-keep].created_at
    dropped = 0
    for ctx in contexts:
        kept = [i for i in ctx.items if not (_trimmable(i) and i.created_at < cutoff)]
        dropped += len(ctx.items) - len(kept)
        ctx.items[:] = kept
    return dropped


def _contexts(session: AgentSession) -> list[llm.ChatContext]:
    """The session's history, the agent's context and the adapter's, as they are now (the framework replaces
    the latter two objects as the call goes on)."""
    activity = getattr(session, "_activity", None)
    agent_ctx = getattr(getattr(activity, "agent", None), "_chat_ctx", None)
    adapter_ctx = getattr(getattr(activity, "realtime_llm_session", None), "_chat_ctx", None)
    return [c for c in (session.history, agent_ctx, adapter_ctx) if isinstance(c, llm.ChatContext)]


def bound_call_memory(session: AgentSession, *, keep: int | None = None, events: int | None = None) -> bool:
    """Keeps a started session's history and event record bounded for the rest of the call (by default to
    `HISTORY_ITEMS` and `EVENTS_KEPT`). False (and a warning) when this livekit-agents keeps them elsewhere."""
    keep = HISTORY_ITEMS if keep is None else keep
    events = EVENTS_KEPT if events is None else events
    recorded = getattr(session, "_recorded_events", None)
    if not isinstance(recorded, list) or len(_contexts(session)) < 3:
        log.warning(
            "this livekit-agents keeps its call history elsewhere: a long call's memory is not bounded"
        )
        return False
    session._recorded_events = RecentEvents(recorded, events)

    def on_item(_: Any) -> None:
        if len(session.history.items) >= 2 * keep:
            trim_contexts(_contexts(session), keep)

    session.on("conversation_item_added", on_item)
    session.on("function_tools_executed", on_item)
    return True
