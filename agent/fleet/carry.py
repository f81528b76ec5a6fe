"""A call's conversation, kept in the booking database while the call lasts, so that an agent that replaces a
lost one (agent/fleet/fleet.py) carries it on instead of starting over: what the agent said (its text channel,
turn by turn), the tool calls it made with their results, and the conversation's key, which scopes its
bookings' idempotency (agent/hotel.py `session_key`), so a booking made before the break is never made twice.

The room's job writes it after each turn and each tool result (in a thread: never on the loop's time), keyed
by the room's sid; a job that replaces a lost agent reads it, and its prompt holds the earlier turns and
results (`resume_context`), its first words acknowledge the break (prompts/resumed.md). It is deleted when the
call ends on purpose (the caller left, a goodbye, a transfer), and any left by a call that never ended
cleanly is purged after KEEP_S; with CHORUS_KEEP_CONVERSATIONS=true an operator keeps them. Knows the store's
statements and the prompt files; nothing of LiveKit or the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from prompts import load_prompt

if TYPE_CHECKING:
    from tools.store.base import Store
    from tools.store.statements import Tx

log = logging.getLogger("chorus.agent.carry")

MAX_TURNS = 24  # the agent's latest turns kept
MAX_TURN_CHARS = 600  # of each
MAX_TOOLS = 12  # the latest tool calls kept
MAX_RESULT_CHARS = 1500  # of each result (the engine cuts results longer than its own bound anyway)
MAX_NAME_CHARS = 64  # of each tool's name
# a row read back is refused above this (before it is parsed): what the limits above let a conversation hold,
# each character written as JSON's longest escape (`\u0000`), and room for the fields' names
MAX_ROW_CHARS = 6 * (MAX_TURNS * MAX_TURN_CHARS + MAX_TOOLS * (MAX_NAME_CHARS + 2 * MAX_RESULT_CHARS)) + 8192
KEEP_S = 3600.0  # a conversation not written this long belongs to a call that is over: purged
PURGE_EVERY_S = 300.0  # how often the worker purges them (agent/fleet/kept.py), as a call starts


@dataclass
class Conversation:
    """What a call has said and done so far. `key`: the conversation's id (its first job's), the scope of its
    bookings' idempotency; `breaks`: how often its agent was lost and replaced."""

    key: str
    said: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments", "output", "is_error"}
    breaks: int = 0
    last_job: str = (
        ""  # the job that carried it last: a call carried on links to its trace (agent/tracing.py)
    )
    saved_at: float = 0.0  # when it was saved last (wall clock, s): about when its last agent last spoke

    def to_json(self) -> str:
        return json.dumps(
            {
                "key": self.key,
                "said": self.said,
                "tools": self.tools,
                "breaks": self.breaks,
                "last_job": self.last_job,
                "saved_at": self.saved_at,
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> Conversation | None:
        """The conversation a row holds, or None for one that is not (another version's row, or damaged, or
        longer than MAX_ROW_CHARS). What a row holds is cut to the limits a conversation is written with
        (the latest MAX_TURNS turns of MAX_TURN_CHARS, MAX_TOOLS tools...): a row written otherwise (by
        hand, another version) never makes a longer prompt."""
        if len(text) > MAX_ROW_CHARS:
            log.warning("a conversation of %d characters was not read (at most %d)", len(text), MAX_ROW_CHARS)
            return None
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(d, dict) or not isinstance(d.get("key"), str) or not d["key"]:
            return None
        said = [s for s in d.get("said", []) if isinstance(s, str)] if isinstance(d.get("said"), list) else []
        tools = [t for t in d.get("tools", []) if _is_tool(t)] if isinstance(d.get("tools"), list) else []
        breaks = d.get("breaks") if type(d.get("breaks")) is int else 0
        # each turn on one line and cut, as `ConversationLog.said` has them
        said = [t[:MAX_TURN_CHARS] for s in said[-MAX_TURNS:] if (t := " ".join(s.split()))]
        tools = [_tool_cut(t) for t in tools[-MAX_TOOLS:]]
        last_job = d.get("last_job") if isinstance(d.get("last_job"), str) else ""
        saved_at = d.get("saved_at") if type(d.get("saved_at")) in (int, float) else 0.0
        return cls(d["key"], said, tools, max(0, breaks), last_job[:MAX_NAME_CHARS], float(saved_at))

    @property
    def empty(self) -> bool:
        return not self.said and not self.tools


def _is_tool(t: object) -> bool:
    return (
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("arguments"), str)
        and isinstance(t.get("output"), str)
    )


def _tool_cut(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": t["name"][:MAX_NAME_CHARS],
        "arguments": t["arguments"][:MAX_RESULT_CHARS],
        "output": t["output"][:MAX_RESULT_CHARS],
        "is_error": t.get("is_error") is True,
    }


def resume_context(c: Conversation) -> str:
    """The prompt's own part for a call whose agent was lost and replaced ("" for none): the earlier turns
    and tool results (prompts/resumed.md), the results in the `<TOOL_RESPONSE>` form the model reads. The
    engine prefills it after the agent's system prompt and tools (`open_session(context=)`), whose state it
    keeps for every call: a call carried on prefills only this."""
    if c.empty:
        return ""
    turns = "\n".join(f"- {s}" for s in c.said) or "- (nothing yet)"
    calls = "\n".join(
        f"- {t['name']}({t['arguments']}) returned <TOOL_RESPONSE>[{t['output']}]</TOOL_RESPONSE>"
        + (" (an error)" if t.get("is_error") else "")
        for t in c.tools
    )
    return load_prompt("resumed", said=turns, tools=calls or "- (none)")


def acknowledgement(handed_over: bool = False) -> str:
    """The first words of an agent that carries a call on after a break, or (`handed_over`) that took the
    call over from a draining worker's agent (forced under teacher forcing, as a greeting is)."""
    return " " + load_prompt("handover_greeting" if handed_over else "resumed_greeting")


def back_again() -> str:
    """The words of an agent whose call dropped for a moment and came back to it (the caller's connection or
    its own rebuilt): forced under teacher forcing."""
    return " " + load_prompt("back_greeting")


class ConversationLog:
    """One call's conversation as it goes: `said`, `called` and `answered` record it and save it to `store`
    under the room's `sid` (one write in flight at a time, the newest state last), `forget` deletes it."""

    def __init__(self, store: Store, sid: str, conversation: Conversation, *, keep: bool = False) -> None:
        self.store, self.sid, self.conversation, self.keep = store, sid, conversation, keep
        self._calls: dict[str, tuple[str, str]] = {}  # call id -> (name, arguments), until answered
        self._dirty = False
        self._saving: asyncio.Task | None = None
        self.held = False  # nothing saved while the agent's connection to its room is down, or once replaced
        self._ended = False  # forgotten: never saved again
        self.stats = {"saves": 0, "failed": 0}

    @classmethod
    async def open(
        cls, store: Store, sid: str, job: str, *, resumed: bool, keep: bool = False
    ) -> ConversationLog:
        """The room's conversation: the one kept for it when this job replaces a lost agent (`resumed`),
        else a new one keyed by `job`. Conversations older than KEEP_S are purged on the way (at most every
        PURGE_EVERY_S in a process)."""

        def read(tx: Tx) -> str | None:
            return tx.conversation(sid)

        found = None
        try:
            if resumed:
                text = await asyncio.to_thread(store.transact, read)
                found = Conversation.from_json(text) if text else None
            if not keep and _purge_due():
                await asyncio.to_thread(purge_stale, store)
        except Exception as e:  # noqa: BLE001 (the call goes on without its history: logged, never raised)
            log.warning("the conversation could not be read (%s)", type(e).__name__)
        if found is not None:
            found.breaks += 1
            return cls(store, sid, found, keep=keep)
        return cls(store, sid, Conversation(job), keep=keep)

    @property
    def resumed(self) -> bool:
        return self.conversation.breaks > 0 and not self.conversation.empty

    def said(self, text: str) -> None:
        text = " ".join(text.split())
        if text:
            c = self.conversation
            c.said = [*c.said, text[:MAX_TURN_CHARS]][-MAX_TURNS:]
            self._changed()

    def called(self, call_id: str, name: str, arguments: str) -> None:
        self._calls[call_id] = (name[:MAX_NAME_CHARS], arguments[:MAX_RESULT_CHARS])

    def answered(self, call_id: str, output: str, is_error: bool) -> None:
        name, arguments = self._calls.pop(call_id, ("", ""))
        if not name:
            return
        c = self.conversation
        entry = {
            "name": name,
            "arguments": arguments,
            "output": output[:MAX_RESULT_CHARS],
            "is_error": is_error,
        }
        c.tools = [*c.tools, entry][-MAX_TOOLS:]
        self._changed()

    def hold(self, held: bool) -> None:
        """Stop saving (the agent's connection to its room is down: another agent may carry the conversation
        on from what is saved), or save again what changed meanwhile."""
        self.held = held or self._ended
        if not self.held and self._dirty:
            self._changed()

    def _changed(self) -> None:
        self._dirty = True
        if self.held:
            return
        if self._saving is None or self._saving.done():
            self._saving = asyncio.get_running_loop().create_task(self._save())

    async def _save(self) -> None:
        while self._dirty and not self.held:
            self._dirty = False
            self.conversation.saved_at = time.time()
            text = self.conversation.to_json()
            try:
                await asyncio.to_thread(
                    self.store.transact, lambda tx, text=text: tx.put_conversation(self.sid, text), write=True
                )
                self.stats["saves"] += 1
            except Exception as e:  # noqa: BLE001 (a lost write loses history, never the call)
                self.stats["failed"] += 1
                log.warning("the conversation could not be saved (%s)", type(e).__name__)

    async def flush(self) -> None:
        """Wait for the writes in flight."""
        if self._saving is not None:
            await asyncio.shield(self._saving)

    async def forget(self) -> None:
        """The call ended on purpose: its conversation is deleted (kept if an operator turned keeping on).
        Nothing is saved from here on, and a write already in its thread is waited for first: cancelling
        its task would not stop the thread, whose row could land after the delete and outlive the call."""
        self._ended = self.held = True
        self._dirty = False
        if self._saving is not None:
            await asyncio.shield(self._saving)
        if self.keep:
            return
        try:
            await asyncio.to_thread(forget_rooms, self.store, [self.sid])
        except Exception as e:  # noqa: BLE001 (purged after KEEP_S)
            log.warning("the conversation could not be deleted (%s)", type(e).__name__)


def forget_rooms(store: Store, sids: list[str]) -> None:
    """The conversations of calls that ended (on purpose, or while no agent was in their room: agent/fleet/
    fleet.py's "over"): deleted, and their bytes scrubbed from the database's files (`Store.scrub`)."""

    def delete(tx: Tx) -> None:
        for sid in sids:
            tx.delete_conversation(sid)

    store.transact(delete, write=True)
    store.scrub()


_last_purge = -PURGE_EVERY_S  # time.monotonic() of this process's last purge


def _purge_due() -> bool:
    global _last_purge
    now = time.monotonic()
    if now - _last_purge < PURGE_EVERY_S:
        return False
    _last_purge = now
    return True


def purge_stale(store: Store) -> int:
    """Delete the conversations not written for KEEP_S (their calls never ended cleanly), scrubbed from the
    database's files; how many. The worker runs it at start and on a timer (agent/fleet/kept.py)."""
    before = store.now() - timedelta(seconds=KEEP_S)
    purged = store.transact(lambda tx: tx.purge_conversations(before), write=True)
    if purged:
        store.scrub()
    return purged
