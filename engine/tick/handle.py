"""What a conversation holds of the engine: `SessionHandle`, made by `Engine.open_session`.

Every method is callable from the session's own thread or event loop; none waits on the tick. What the tick
acts on (tool results, forced tokens, padding) goes through the session's `requests` queue, which the tick
thread drains; the handle writes only the inbox, `private` (under its lock) and the room's playout figures.
Knows one session's slot state and inbox; knows nothing of LiveKit, rooms or hotels.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.api import EngineClosed, ForceTokens, Output, SubmitResult
from engine.text.tokens import forced_ids
from engine.tick.session import Hold, Session
from engine.transport.link import RECEIVE_AT
from engine.transport.wire import shape_error
from redaction import private_values

if TYPE_CHECKING:
    from engine.config.engine_config import EngineConfig
    from engine.text.tokens import Tokens
    from engine.tick.slots import SlotPool


class HandleHost(Protocol):
    """What a handle uses of its engine (engine/tick/engine.py `Engine`)."""

    config: EngineConfig
    tokens: Tokens
    vocab_size: int
    pool: SlotPool


class SessionHandle:
    """What a conversation holds: push caller audio, read outputs, answer function calls, close."""

    def __init__(self, engine: HandleHost, session: Session, outputs) -> None:
        self._engine = engine
        self._s = session
        self.id = session.id
        self.outputs = outputs  # asyncio.Queue (with a loop), queue.Queue (without), or None (with a sink)
        self._private_lock = threading.Lock()

    @property
    def phase(self) -> str:
        return self._s.phase.value

    @property
    def closed(self) -> bool:
        return self._s.closed

    @property
    def slot(self) -> int:
        """The engine slot (row of every stage's state) this session holds."""
        return self._s.slot

    @property
    def speaking(self) -> bool:
        """The agent is in a turn of its own."""
        return self._s.turn.speaking

    @property
    def backlog_frames(self) -> int:
        """Caller frames received and not yet heard by the model."""
        return len(self._s.inbox)

    @property
    def frames_in(self) -> int:
        """Caller frames this session received (also after it closed)."""
        return self._s.inbox.frames_in

    def push_audio(self, pcm: np.ndarray) -> None:
        """Caller audio at 16 kHz mono, int16 or float in [-1, 1], any length; cut into 1280-sample frames."""
        if self._s.closed:
            raise EngineClosed(f"session {self.id} is closed")
        self._s.inbox.push(pcm)

    def submit_tool_result(self, call_id: str, output: str, is_error: bool = False) -> None:
        """The result of a FunctionCall; results for unknown or already answered calls are ignored. The
        personal values of the call's arguments and of its result (when that is a JSON object) are kept
        private from now on: names, contacts, codes (`privacy.private_values`)."""
        if self._s.closed:
            return
        call = self._s.call.pending.get(call_id)  # a read: the tick replaces the dict, never changes it here
        if call is not None:
            self.keep_private(*private_values(call.arguments), *private_values(_json_object(output)))
        # every character is prefilled on the tick: a longer result is cut, and the model reads a
        # note saying so
        output, cap = str(output), self._engine.config.max_result_chars
        if len(output) > cap:
            output = f"{output[:cap]} [the result was cut: {len(output)} characters, the first {cap} kept]"
        self._s.requests.put(SubmitResult(call_id, output, bool(is_error)))

    def keep_private(self, *terms: str) -> None:
        """Words this conversation must never show in clear: a guest's name (each of its words too), a
        contact, a code. The snapshot's `last_words` replace them with "[name]" from now on
        (redaction/). Callable from any thread; the terms live as long as the session."""
        fresh = tuple(t.strip()[:200] for t in terms if isinstance(t, str) and t.strip())
        with self._private_lock:
            self._s.private = tuple(dict.fromkeys(self._s.private + fresh))

    def force_text(self, tokens: list[int] | str) -> None:
        """Teacher forcing: the text channel emits these tokens (one per position) instead of its own."""
        self._s.requests.put(ForceTokens("text", tuple(self._ids(tokens))))

    def force_function(self, tokens: list[int] | str) -> None:
        """Teacher forcing of the function channel (e.g. a complete tool call from `Tokens.call_ids`)."""
        self._s.requests.put(ForceTokens("function", tuple(self._ids(tokens))))

    def pad_between(self, on: bool = True) -> None:
        """Teacher forcing: between forced tokens both channels emit the padding token in live steps
        (`on`), or the model's own again."""
        self._s.requests.put(Hold(self._engine.tokens.pad if on else -1))

    def report_playout(
        self,
        queued_s: float,
        gaps: int,
        gap_s: float,
        start_delay_s: float,
        turn_played_at: float = 0.0,
        late_absorbed: int = 0,
    ) -> None:
        """The room's playout, for the snapshot and /metrics: audio queued ahead of the caller's ear, the
        gaps of this call and their seconds, a turn's start delay, when the last turn's first sample went
        to the track (time.monotonic), the late frames it absorbed without a gap this call
        (engine/transport/link.py PLAYOUT_FIELDS)."""
        self._s.playout[:RECEIVE_AT] = (queued_s, gaps, gap_s, start_delay_s, turn_played_at, late_absorbed)

    def report_receive(self, jitter_s: float, concealed_s: float) -> None:
        """The room's receive side of the caller's audio, for the snapshot and /metrics: WebRTC's jitter
        buffer's mean delay lately, and the audio it concealed this call (agent/audio_in/receive_stats.py)."""
        self._s.playout[RECEIVE_AT:] = (jitter_s, concealed_s)

    def _ids(self, tokens: list[int] | str) -> list[int]:
        return forced_ids(self._engine.tokens, tokens, self._engine.vocab_size)

    def close(self) -> None:
        """Free the slot; a late tool result or audio is discarded. Idempotent."""
        self._engine.pool.close(self._s)


def _json_object(text: object) -> dict:
    """`text` parsed as a JSON object, or {} (a result may be any text: one too long, or nested deeper than
    the wire's MAX_DEPTH, is not parsed, and reaches the model as the text it is)."""
    if not isinstance(text, str | bytes) or len(text) >= 1_000_000:
        return {}
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if shape_error(raw) is not None:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def delivery(
    loop: asyncio.AbstractEventLoop | None, sink: Callable[[list[Output]], None] | None
) -> tuple[asyncio.Queue | queue.Queue | None, Callable[[list[Output]], None]]:
    """Where a session's outputs go, and the function the tick thread calls with each tick's: the sink itself
    (called on the tick thread), else an asyncio.Queue filled on `loop` (from the tick thread through
    `call_soon_threadsafe`), else a queue.Queue."""
    if sink is not None:
        return None, sink
    if loop is not None:
        aq: asyncio.Queue = asyncio.Queue()

        def to_loop(items: list[Output]) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, aq, items)

        return aq, to_loop
    q: queue.Queue = queue.Queue()

    def to_queue(items: list[Output]) -> None:
        for item in items:
            q.put(item)

    return q, to_queue


def _put_all(q: asyncio.Queue, items: list[Output]) -> None:
    for item in items:
        q.put_nowait(item)
