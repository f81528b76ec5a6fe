"""What `Engine.open_session` works out before it takes a slot, and what it wraps around the new session: the
tools and the call's context checked and the prompt tokenised (`SessionRejected` otherwise), the distinct
system prompts open sessions are still waiting to have prefilled (which the engine bounds), and the
session's delivery wrapped so that the engine accounts every resume after a tool result.

Runs on the thread that opens the session (an agent's event loop, or the engine's door), but for the wrapped
delivery, which the tick thread calls. Reads the pool's sessions and the prompt cache's keys across threads:
a snapshot, good enough for admission. Knows the tokeniser, the sessions' phases and the outputs' kinds;
knows nothing of the model, the tick's timing or LiveKit.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.api import Output, SessionRejected, ToolResultConsumed
from engine.observe.metrics import Accounting
from engine.text.tokens import MAX_TOOLS, Tokens
from engine.tick.session import Phase, Session


def requested_prompt(
    tokens: Tokens, prompt: str, tools: list[dict] | None, context: str
) -> tuple[list, list[int], int]:
    """The tools' names, the prompt's token ids and the length of the part every call of the same agent
    shares (system prompt and tools), or SessionRejected."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise SessionRejected(f"tools: the model accepts at most {MAX_TOOLS} tools, got {len(tools)}")
    names = [t.get("name") for t in tools]
    if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
        raise SessionRejected("tools: every tool needs a distinct, non-empty name")
    if not isinstance(context, str):
        raise SessionRejected("context: a string")
    try:
        prompt_ids, prefix_len = tokens.prompt_parts(prompt, tools, context)
    except ValueError as e:
        raise SessionRejected(str(e)) from None
    return names, prompt_ids, prefix_len


def prompts_prefilling(sessions: dict[str, Session], cached: frozenset[int]) -> set[int]:
    """Distinct system prompts not yet `cached` that open sessions are waiting for (read across threads:
    a snapshot, good enough for admission)."""
    return {
        key
        for s in list(sessions.values())
        if s.phase is Phase.PROMPT and not s.closed and (key := s.prefill_key) not in cached
    }


def accounted(acct: Accounting, deliver: Callable[[list[Output]], None]) -> Callable[[list[Output]], None]:
    def wrapped(items: list[Output]) -> None:
        for item in items:
            if isinstance(item, ToolResultConsumed):
                acct.record_resume(item.resume_ms)
        deliver(items)

    return wrapped
