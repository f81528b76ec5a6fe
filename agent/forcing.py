"""Teacher forcing: scripted agent turns and tool calls for an engine that runs dummy weights.

Dummy (seeded random) weights decide nothing, so where a run needs the agent to speak or to call a tool, the
tokens are forced on the model's own channels: the text channel for what it says, the function channel for a
call. The talker, the codec, the tools and the database then do their real work on them. Everything forced is
counted and reported as scripted; nothing here pretends to be the model's own choice.

`Forcing` is the per-slot queue (`simulate` and the worker share it). `run_script` is the worker's: with
`CHORUS_TEACHER_FORCING=true` a room's agent greets the caller, answers at a fixed cadence, and makes the tool
calls that the job's dispatch metadata lists
(`{"script": {"greeting": "...", "calls": [{"at_s": 3, "name": ..., "arguments": {...}}]}}`). It is for dummy
weights (tests, demos, LiveKit's load tester, which needs an agent that speaks first); a real checkpoint is
never forced.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.call import Call
    from engine.api import EngineClient

log = logging.getLogger("chorus.agent.forcing")

GREETING = " Hello, thank you for calling the Grand Hotel. How can I help you today?"
REPLIES = [
    " Of course, I can help with that.",
    " Certainly. What dates are you thinking of?",
    " Sure, let me see what we have.",
    " Happy to help. Anything else I can do?",
]
AFTER_TOOL = " Thanks for waiting."
CALLING = " Hello, this is the Grand Hotel calling."  # an outbound call's greeting: the agent speaks first
REPLY_EVERY_S = 6.0
SCRIPT_POLL_S = 0.1  # how often a room's script looks at its call (the engine pads between its messages)


class Forcing:
    """Teacher forcing of one room's model: scripted turns on the text channel, scripted calls on the function
    channel, and between them padding on both (the engine's `pad_between`), so the dummy weights never start
    turns or calls of their own, however late the script's next message comes. A scripted turn starts on the
    first live tick after it reaches the engine."""

    def __init__(self, handle: Any, tok: Any, duplex: Any) -> None:
        self.handle, self.tok, self.duplex = handle, tok, duplex
        self._pauses_at_call = 0
        handle.pad_between(True)

    def text(self, ids: list[int]) -> None:
        self.handle.force_text(ids)

    def say(self, words: str) -> None:
        """One scripted turn: `words` on the text channel, between the turn's start and end tokens."""
        self.text([self.tok.bos, *self.tok.encode(words), self.tok.eos])

    def call(self, ids: list[int]) -> None:
        self.handle.force_function(ids)  # only its first token takes a live tick; the rest run while paused
        self._pauses_at_call = self.duplex.stats["pauses"]

    def call_paused(self) -> bool:
        """Whether the last forced call has paused the session: it is paused now, or a pause began and ended
        since (a fast tool between two polls of a script), so a reply forced now follows the result."""
        return self.duplex.paused or self.duplex.stats["pauses"] > self._pauses_at_call


@dataclass
class Script:
    """What a room's agent is made to do: greet (with `greeting`), reply every `reply_every_s`, and make
    `calls` (each a dict with `at_s`, seconds after the greeting, `name`, `arguments`, and `then`, the words
    said once the tool's result is in, AFTER_TOOL when not given). A call the hotel placed
    (`python -m agent sip call`, metadata `{"direction": "outbound", "reason": ...}`) is greeted with
    CALLING and the reason. `reconnect_at_s`: a fault to inject, the agent's own room connection rebuilt (the
    rtc SDK's full reconnect, as after a network loss) that many seconds after the call opened."""

    greet: bool = True
    greeting: str = GREETING
    reply_every_s: float = REPLY_EVERY_S
    calls: list[dict] = field(default_factory=list)
    reconnect_at_s: float | None = None

    @classmethod
    def from_metadata(cls, metadata: str | None) -> Script:
        """The script in a job's dispatch metadata (`{"script": {...}}`); the default one for anything else. A
        malformed script is logged (without its content) and ignored, never fatal to the call."""
        try:
            meta = json.loads(metadata or "{}")
            raw = meta.get("script", {}) if isinstance(meta, dict) else {}
            calls = [
                {
                    "at_s": float(c["at_s"]),
                    "name": str(c["name"]),
                    "arguments": dict(c.get("arguments", {})),
                    "then": _words(c.get("then", AFTER_TOOL)),
                }
                for c in raw.get("calls", [])
            ]
            greeting = GREETING
            if isinstance(meta, dict) and meta.get("direction") == "outbound":
                reason = meta.get("reason")
                reason = reason.strip()[:GREETING_MAX] if isinstance(reason, str) else ""
                greeting = f"{CALLING} {reason}" if reason else CALLING
            return cls(
                greet=bool(raw.get("greet", True)),
                greeting=_words(raw.get("greeting", greeting)),
                reply_every_s=float(raw.get("reply_every_s", REPLY_EVERY_S)),
                calls=sorted(calls, key=lambda c: c["at_s"]),
                reconnect_at_s=None if raw.get("reconnect_at_s") is None else float(raw["reconnect_at_s"]),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning(
                "the job's script could not be read (%s); the default script is used", type(e).__name__
            )
            return cls()


GREETING_MAX = 500  # characters of a scripted greeting


def _words(text: object) -> str:
    """A scripted line: a string of at most GREETING_MAX characters (ValueError otherwise)."""
    if not isinstance(text, str) or not text.strip() or len(text) > GREETING_MAX:
        raise ValueError(f"a scripted line is a string of 1 to {GREETING_MAX} characters")
    return text


async def run_script(
    call: Call, engine: EngineClient, script: Script, cues: asyncio.Queue[str] | None = None
) -> dict[str, int]:
    """Drive one call's model by `script` until the call ends; returns what was forced (turns, calls).
    `cues`: lines the call asks for as things happen (the agent back after a dropped line), each said at the
    next poll the session is not paused; several waiting at once are said once, the latest."""
    loop = asyncio.get_running_loop()
    forced = {"turns": 0, "calls": 0}
    try:
        handle = await call.wait_open(timeout=60.0)
    except Exception:  # noqa: BLE001 (the call never opened, for whatever reason: its own error path reports that)
        return forced  # the call never opened: its own error path reports that
    tok = engine.tokens
    while not call.closed and not (call.duplex is not None and call.duplex.live):
        await asyncio.sleep(0.02)
    if call.closed or call.duplex is None:
        return forced
    force = Forcing(handle, tok, call.duplex)
    t0 = loop.time()
    if script.greet:
        force.say(script.greeting)
        forced["turns"] += 1
    pending = list(script.calls)
    next_reply = t0 + script.reply_every_s if script.reply_every_s > 0 else float("inf")
    thanks_due = False
    then = AFTER_TOOL
    replies = 0
    try:
        while not call.closed and not handle.closed:
            now, duplex = loop.time(), call.duplex
            if cues is not None and not cues.empty() and not duplex.paused and not thanks_due:
                line = cues.get_nowait()
                while not cues.empty():
                    line = cues.get_nowait()
                force.say(line)
                forced["turns"] += 1
                next_reply = now + script.reply_every_s if script.reply_every_s > 0 else next_reply
            elif pending and now - t0 >= pending[0]["at_s"] and not duplex.paused and not thanks_due:
                c = pending.pop(0)
                force.call(tok.call_ids([{"name": c["name"], "arguments": c["arguments"]}]))
                forced["calls"] += 1
                thanks_due, then = True, c.get("then", AFTER_TOOL)
            elif thanks_due and force.call_paused():
                force.say(then)  # forced while paused: spoken as soon as the result is consumed
                forced["turns"] += 1
                thanks_due = False
            elif now >= next_reply and not duplex.paused:
                force.say(REPLIES[replies % len(REPLIES)])
                forced["turns"] += 1
                replies += 1
                next_reply = now + script.reply_every_s
            await asyncio.sleep(SCRIPT_POLL_S)
    except Exception:  # the session ended under us (closed handle): the script simply stops
        log.debug("script stopped", exc_info=True)
    return forced
