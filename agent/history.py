"""A call's memory stays bounded however long the call lasts: the one place Chorus reaches into
livekit-agents' private state.

livekit-agents keeps, for every session, the whole conversation three times over (the session's history,
the agent's chat context, the duplex adapter's copy of what the model has been told) and every event it
emitted (for its session report). A duplex model keeps its own context in the engine, so none of these is
read back to generate anything; on a call that lasts an hour they only grow. `bound_call_memory` keeps the
newest `HISTORY_ITEMS` chat items (instructions and configuration items are always kept) and the newest
`EVENTS_KEPT` events. All three contexts are trimmed at the same moment to the same creation-time cutoff, so
the adapter's diff between them never sees an item removed or re-created.

The framework has no public way to do this: `Agent.update_chat_ctx` replaces the agent's context, but the
duplex adapter then logs every item removed as an edit of its append-only context; the adapter shows its
context only as a copy; the event record has no API. So this module, and nothing else in Chorus, relies on
the private attributes in `PRIVATE`; tests/test_history_adapter.py fails when the installed livekit-agents
changes any of them. The rest goes through public API (`AgentSession.history`, `AgentSession.current_agent`,
`Agent.realtime_llm_session`). Knows livekit-agents' sessions and chat contexts; nothing of the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from livekit.agents import Agent, AgentSession, llm

log = logging.getLogger("chorus.agent.history")

HISTORY_ITEMS = 64  # chat items a call keeps (the engine has its own context; these are for transcripts)
EVENTS_KEPT = 128  # session events a call keeps (livekit's session report)
_TRIMMED = ("message", "function_call", "function_call_output")

# what is relied on, where, and for what (tests/test_history_adapter.py checks each against the framework)
PRIVATE = {
    "AgentSession._recorded_events": "the list AgentSession.emit appends every event to, and the one "
    "JobContext.make_session_report reads; replaced by a bounded list",
    "Agent._chat_ctx": "the agent's own context, of which Agent.chat_ctx is a read-only view; "
    "trimmed in place",
    "_DuplexRealtimeSession._chat_ctx": "the duplex adapter's context, which its update_chat_ctx diffs the "
    "agent's against; trimmed in place, in step with the agent's",
}


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


def _agent(session: AgentSession) -> Agent | None:
    try:
        return session.current_agent
    except RuntimeError:  # no agent running
        return None


def _adapter(agent: Agent | None) -> llm.RealtimeSession | None:
    try:
        return agent.realtime_llm_session if agent is not None else None
    except RuntimeError:  # the agent is not running, or runs no realtime session
        return None


def contexts(session: AgentSession) -> list[llm.ChatContext]:
    """The session's history, the agent's context and the adapter's, the live objects as they are now (the
    framework replaces the latter two as the call goes on); fewer than three where one is not there."""
    agent = _agent(session)
    agent_ctx = getattr(agent, "_chat_ctx", None)
    adapter_ctx = getattr(_adapter(agent), "_chat_ctx", None)
    return [c for c in (session.history, agent_ctx, adapter_ctx) if isinstance(c, llm.ChatContext)]


def recorded_events(session: AgentSession) -> list[Any] | None:
    """The session's event record (what its session report lists), or None where this livekit-agents keeps
    it elsewhere."""
    recorded = getattr(session, "_recorded_events", None)
    return recorded if isinstance(recorded, list) else None


def bound_call_memory(session: AgentSession, *, keep: int | None = None, events: int | None = None) -> bool:
    """Keeps a started session's history and event record bounded for the rest of the call (by default to
    `HISTORY_ITEMS` and `EVENTS_KEPT`).
    False (and a warning) when this livekit-agents keeps them elsewhere."""
    keep = HISTORY_ITEMS if keep is None else keep
    events = EVENTS_KEPT if events is None else events
    recorded = recorded_events(session)
    if recorded is None or len(contexts(session)) < 3:
        log.warning(
            "this livekit-agents keeps its call history elsewhere: a long call's memory is not bounded"
        )
        return False
    session._recorded_events = RecentEvents(recorded, events)

    def on_item(_: Any) -> None:
        if len(session.history.items) >= 2 * keep:
            trim_contexts(contexts(session), keep)

    session.on("conversation_item_added", on_item)
    session.on("function_tools_executed", on_item)
    return True
