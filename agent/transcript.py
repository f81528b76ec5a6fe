"""The agent's words in the room: the `lk.transcription` text stream, written beside the audio, never in
its way.

The framework forwards a turn's text and waits for every write before it counts the turn as done; its
own room output makes two native requests per text piece (the text stream and the legacy transcription
event) and waits for both callbacks. When the rtc runtime is slow to answer (a worker short of CPU, a
server slow to ack), a turn's text then holds up the turn itself, and every turn after it queues behind:
the caller hears nothing more.

`RoomTranscript` takes the text at once and returns. One task per call writes it: one stream per turn
(its segment), opened at the turn's first words, written with whatever arrived since the last write
(pieces coalesce while a write is in flight, so a slow runtime costs fewer writes, not a backlog, and a
turn's stream is written at most every WRITE_EVERY_S: the model's text comes a token per 80 ms frame, and
each write is a request to the runtime and a callback back on the room's loop), closed with
`lk.transcription_final` when the turn ends, with what is left, at once. Every native wait is bounded (a
stream's opening longest, since the first waits for the agent's data channel); a turn whose stream stalls or
fails is abandoned and counted, and the next turn gets a stream of its own. Knows livekit-agents' text output
and the rtc text streams; nothing of the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from livekit import rtc
from livekit.agents import io, utils
from livekit.agents.types import ATTRIBUTE_TRANSCRIPTION_FINAL as FINAL
from livekit.agents.types import ATTRIBUTE_TRANSCRIPTION_SEGMENT_ID as SEGMENT_ID
from livekit.agents.types import ATTRIBUTE_TRANSCRIPTION_TRACK_ID as TRACK_ID
from livekit.agents.types import TOPIC_TRANSCRIPTION as TOPIC

from agent.audio_out.playout_timing import Wake

log = logging.getLogger("chorus.agent.transcript")

WAIT_S = 5.0  # the longest one native request of a stream may take before its turn's text is given up
# ... but opening one: the first stream waits for the agent's data channel to the server, which a worker busy
# with a burst of joining rooms can take many seconds to set up; a greeting's words are kept that long
OPEN_WAIT_S = 20.0
MAX_TURNS = 8  # turns waiting for their stream; beyond, the oldest not yet begun is dropped (and counted)
WRITE_EVERY_S = 0.25  # a turn's words go out at most this often (its first at once, its last as it ends)


@dataclass
class _Turn:
    id: str = field(default_factory=lambda: utils.shortuuid("SG_"))
    pieces: list[str] = field(default_factory=list)
    sent: int = 0  # pieces written so far
    next_write: float = 0.0  # the loop's time before which what is new waits (unless the turn ends)
    ended: bool = False
    writer: rtc.TextStreamWriter | None = None


class RoomTranscript(io.TextOutput):
    """The agent's transcription on the room (see the module docstring). `track_sid`: the agent's audio track
    (or a function that gives its id as it is now: a full reconnect publishes it again under a new one), named
    on every stream so a client can pair the words with the voice."""

    def __init__(
        self,
        room: rtc.Room,
        track_sid: str | Callable[[], str | None] | None = None,
        *,
        wait_s: float = WAIT_S,
        open_wait_s: float = OPEN_WAIT_S,
        write_every_s: float = WRITE_EVERY_S,
    ) -> None:
        super().__init__(label="chorus-transcript", next_in_chain=None)
        self._room, self._track_sid, self._wait_s, self._open_wait_s = room, track_sid, wait_s, open_wait_s
        self._write_every_s = write_every_s
        self._turns: deque[_Turn] = deque()
        self._open: _Turn | None = None  # the turn being captured
        self._wake = asyncio.Event()
        self._ended = Wake()  # a turn ended: what it has left goes now
        self._task: asyncio.Task | None = None
        self._closed = False
        self.stats = {"turns": 0, "writes": 0, "failed": 0, "dropped": 0}

    # -- io.TextOutput: never waits ----------------------------------------------------------------------

    async def capture_text(self, text: str) -> None:
        if self._closed or not text:
            return
        if self._open is None:
            self._open = _Turn()
            self._turns.append(self._open)
            self._bound()
        self._open.pieces.append(text)
        self._kick()

    def flush(self) -> None:
        if self._open is not None:
            self._open.ended = True
            self._open = None
            self._ended.set()
            self._kick()

    async def aclose(self) -> None:
        """Stop writing; a stream left open is closed within the bound."""
        self._closed = True
        if self._task is not None:
            await utils.aio.cancel_and_wait(self._task)
            self._task = None
        for turn in self._turns:
            with contextlib.suppress(
                Exception
            ):  # closing: a stream whose room is gone cannot be finished, and nothing waits on it
                await self._close_stream(turn, self._attrs(final=True))
        self._turns.clear()

    # -- the writer ----------------------------------------------------------------------------------------

    def _kick(self) -> None:
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._write_turns(), name="chorus.transcript")

    def _bound(self) -> None:
        """The first turn is the one being written (its stream may be opening) and the last the one being
        captured: the oldest between them that has no stream yet goes."""
        while len(self._turns) > MAX_TURNS:
            waiting = list(self._turns)[1:]
            victim = next((t for t in waiting if t.writer is None and t is not self._open), None)
            if victim is None:
                return
            self._turns.remove(victim)
            self.stats["dropped"] += 1

    def _attrs(self, *, final: bool) -> dict[str, str]:
        attrs = {FINAL: "true" if final else "false"}
        sid = self._track_sid() if callable(self._track_sid) else self._track_sid
        if sid:
            attrs[TRACK_ID] = sid
        return attrs

    async def _write_turns(self) -> None:
        while not self._closed:
            if not self._turns:
                await self._until_woken()
                continue
            turn = self._turns[0]
            early = turn.next_write - asyncio.get_running_loop().time()
            if early > 0 and not turn.ended:  # what is new waits for its time, or for the turn's end
                await self._ended.sleep(early)
                continue
            try:
                done = await self._advance(turn)
            except Exception as e:  # noqa: BLE001 (a stalled or failed stream: this turn's words are given up)
                done = True
                self.stats["failed"] += 1
                if self.stats["failed"] == 1 or self.stats["failed"] % 50 == 0:
                    log.warning("the agent's transcription could not be sent (%s)", type(e).__name__)
                with contextlib.suppress(
                    Exception
                ):  # the turn is given up already (counted above): its stream's close may fail too
                    await self._close_stream(turn, None)
            if done:
                self._turns.popleft()
            elif turn.sent == len(turn.pieces) and not turn.ended:  # all written so far: until more comes
                await self._until_woken()

    async def _until_woken(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    async def _close_stream(self, turn: _Turn, attributes: dict[str, str] | None) -> None:
        if turn.writer is not None:
            writer, turn.writer = turn.writer, None
            await asyncio.wait_for(writer.aclose(attributes=attributes), self._wait_s)

    async def _advance(self, turn: _Turn) -> bool:
        """One step of a turn's stream: open it, write what is new, or close it. True once it is closed."""
        if not self._room.isconnected():
            return True
        if turn.sent < len(turn.pieces):
            text = "".join(turn.pieces[turn.sent :])
            n = len(turn.pieces)
            if turn.writer is None:
                attrs = {**self._attrs(final=False), SEGMENT_ID: turn.id}
                turn.writer = await asyncio.wait_for(
                    self._room.local_participant.stream_text(topic=TOPIC, attributes=attrs), self._open_wait_s
                )
                self.stats["turns"] += 1
            await asyncio.wait_for(turn.writer.write(text), self._wait_s)
            turn.sent = n
            turn.next_write = asyncio.get_running_loop().time() + self._write_every_s
            self.stats["writes"] += 1
            return False
        if turn.ended:
            await self._close_stream(turn, self._attrs(final=True))
            return True
        return False
