"""One room's connection to the engine's door (engine/door/host.py), as the engine holds it: its socket
buffers, the session it opened, what a room may ask of that session, and the tick thread's side of the
session's shared memory (caller frames pulled into the inbox, outputs written out).

Knows the session handle, the shared-memory layout and the wire's event message; nothing of the selector
loop, admissions or the socket's life, which are the door's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.api import (
    AudioFrame,
    ForceTokens,
    KeepPrivate,
    Output,
    PadBetween,
    SubmitResult,
    ToolCallStarted,
    TurnEnded,
    TurnStarted,
)
from engine.transport.link import IN_W, SessionLink
from engine.transport.wire import decode_request, encode, event_message

if TYPE_CHECKING:
    from engine.tick.handle import SessionHandle
    from engine.tick.slots import FrameInbox

# frames outside the model's turns (no text, no event) wake the room's loop once per this many: it has nothing
# to do with them but count them, and reads them all at once (the ring holds 64); a turn's frames, a frame
# with text and the session's first frame wake it at once
QUIET_WAKE = 16


class RoomConn:
    """One room connection and the session it holds. `stats` is the door's counters (lost frames, bad ring
    counters); `post(conn, message)` queues an event for the door's thread to send."""

    def __init__(
        self,
        sock: socket.socket,
        stats: dict[str, int],
        post: Callable[[RoomConn, bytes], None],
        peer: int = 0,
    ) -> None:
        self.sock = sock
        self.peer = peer  # the process id at the other end (the kernel's, as the connection was accepted)
        self.rx = bytearray()
        self.tx = bytearray()  # what waits to be sent; never more than the door's MAX_QUEUED
        self.fds: tuple[int, int] | None = None  # the session's descriptors, sent with the byte at `fds_at`
        self.fds_at = 0
        self.opening = False  # its `open` is being handled off the door's thread: its messages wait
        self.later: list[bytes] = []  # what the session sent meanwhile, for after the answer to `open`
        self.handle: SessionHandle | None = None
        self.link: SessionLink | None = None
        self.efd = -1
        self.closed = False
        self.role: str | None = None  # engine/door/gate.py: the role its key gave it, None until then
        self.in_session = False  # engine/door/gate.py: counted with the sessions, no longer with the idle
        self._stats = stats
        self._post = post
        # the tick thread's view of the rings (only it reads and writes these)
        self.in_r = 0
        self.out_w = 0
        self.events = 0
        self.speaking = False  # between the session's TurnStarted and TurnEnded
        self.unsignalled = 0  # frames written since the room's loop was last woken

    # -- the tick thread's side (keep it cheap: no syscall but one eventfd write, nothing allocated) ------

    def pull(self, inbox: FrameInbox) -> None:
        """The room's caller frames written since the last tick, into the session's inbox (the take's time
        published to the room: when its frames are taken, CLOCK_MONOTONIC as their write times are)."""
        link = self.link
        if link is None or self.closed:
            return
        frames, stamps, self.in_r, lost = link.take_caller(self.in_r, time.monotonic())
        if lost < 0:
            self._stats["bad_counters"] += 1
        else:
            self._stats["lost_frames"] += lost
        if frames.size:
            inbox.push(frames.reshape(-1), at=stamps)

    def pending(self) -> bool:
        """Whether the room has written a caller frame the tick has not taken yet."""
        link = self.link
        return link is not None and not self.closed and link.get(IN_W) > self.in_r

    def deliver(self, items: list[Output]) -> None:
        """The session's outputs: audio frames into the shared memory (and an eventfd signal: at once for a
        turn's frames, QUIET_WAKE at a time for the silence between turns), every other output numbered and
        queued for the socket (whose message wakes the room too, and it reads the frames before it)."""
        link = self.link
        if link is None or self.closed:
            return
        wake = False
        for item in items:
            kind = type(item)
            if kind is AudioFrame:
                link.put_agent(self.out_w, item.samples, item.text, item.tick, self.events)
                wake = wake or self.speaking or bool(item.text) or self.out_w == 0
                self.out_w += 1
                self.unsignalled += 1
            else:
                if kind is TurnStarted:
                    self.speaking = True
                elif kind is TurnEnded or kind is ToolCallStarted:
                    self.speaking = False
                self.events += 1
                self._post(self, encode(event_message(self.events, self.out_w, item)))
        if self.unsignalled and (wake or self.unsignalled >= QUIET_WAKE):
            self.unsignalled = 0
            with contextlib.suppress(OSError):
                os.eventfd_write(self.efd, 1)


def apply_session_op(handle: SessionHandle, op: str, msg: dict[str, Any]) -> None:
    """A room's request of its own session (engine/transport/wire.py `decode_request`); ValueError for a
    malformed one or an operation that is none."""
    match decode_request(op, msg):
        case SubmitResult(call_id, output, is_error):
            handle.submit_tool_result(call_id, output, is_error)
        case ForceTokens("text", ids):
            handle.force_text(list(ids))
        case ForceTokens(_, ids):
            handle.force_function(list(ids))
        case PadBetween(on):
            handle.pad_between(on)
        case KeepPrivate(terms):
            handle.keep_private(*terms)
