"""A session of the engine as a room's process holds it: `RemoteHandle`, made by engine/client/remote.py
`RemoteEngine.open_session`, with `SessionHandle`'s surface (`push_audio`, `outputs`, `submit_tool_result`,
`force_text`, `force_function`, `pad_between`, `keep_private`, `close`).

Runs in a room's process, on the session's event loop. Caller frames go into the session's shared memory and
agent frames come out of it (engine/transport/link.py); the socket carries the rest. The outputs reach the
session's event loop in the order the tick made them: a frame waits for the events numbered before it, an
event for the frames written before it. When the engine's side goes away (its process ended, or the session
was closed there) the session gets one `SessionFailed` and is closed; a room never waits on the engine for
longer than `REQUEST_TIMEOUT_S`. Knows sockets, the shared-memory layout and asyncio; nothing of LiveKit or
the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.api import (
    AudioFrame,
    EngineClosed,
    ForceTokens,
    KeepPrivate,
    Output,
    PadBetween,
    Request,
    SessionFailed,
    SubmitResult,
)
from engine.text.tokens import forced_ids
from engine.transport.link import IN_W, OUT_R, OUT_W, RECEIVE_AT, CallerRing, SessionLink
from engine.transport.wire import decode_event, encode, request_message

if TYPE_CHECKING:
    from engine.text.tokens import Tokens

log = logging.getLogger("chorus.engine.remote")

REQUEST_TIMEOUT_S = 10.0  # hello and open: the engine's answer, or EngineClosed


class RemoteHost(Protocol):
    """What a handle uses of its engine (engine/client/remote.py `RemoteEngine`)."""

    vocab_size: int
    on_drain: Callable[[float], None] | None

    @property
    def tokens(self) -> Tokens: ...


class RemoteHandle:
    """A session of a `RemoteEngine` (see the module docstring); everything runs on the session's loop."""

    def __init__(
        self,
        engine: RemoteHost,
        sock: socket.socket,
        pending: bytearray,
        link: SessionLink,
        efd: int,
        opened: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._engine, self._sock, self._rx, self._link, self._efd = engine, sock, pending, link, efd
        self.id: str = str(opened["session"])
        self.slot: int = int(opened["slot"])
        self.outputs: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._closed = False
        self._tail = np.zeros(0, np.int16)
        self._in_w = 0
        self._out_r = 0
        self._events: dict[int, tuple[int, Output]] = {}  # seq -> (frames before it, event)
        self._next_event = 1
        self._on_close: list[Callable[[], None]] = []
        self.stats = {"frames_in": 0, "ring_full": 0, "frames_out": 0, "frames_lost": 0, "refused": 0}
        sock.setblocking(False)
        loop.call_soon_threadsafe(self._attach)

    def _attach(self) -> None:
        if self._closed:
            return
        self._loop.add_reader(self._sock.fileno(), self._on_socket)
        self._loop.add_reader(self._efd, self._on_frames)
        self._on_socket()  # anything that came with the answer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def frames_in(self) -> int:
        """Caller frames this room put in the engine's ring (a full ring's are counted in `stats`)."""
        return self.stats["frames_in"]

    # -- calls into the engine ----------------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray) -> None:
        """Caller audio at the engine's input rate, int16 or float in [-1, 1], any length: whole frames go
        into the ring (a full ring drops the frame and counts it), the rest waits for the next push."""
        if self._closed:
            raise EngineClosed(f"session {self.id} is closed")
        a = np.asarray(pcm)
        if a.ndim != 1:
            raise ValueError(f"push_audio: expected mono samples of shape (n,), got shape {a.shape}")
        if a.dtype != np.int16:
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"push_audio: expected int16 or float samples, got {a.dtype}")
            a = (np.clip(np.nan_to_num(a, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0) * 32767).astype(
                np.int16
            )
        if self._tail.size:
            a = np.concatenate([self._tail, a])
        n = self._link.layout.in_samples
        whole = a.size // n
        now = time.monotonic()
        for k in range(whole):
            if self._link.put_caller(self._in_w, a[k * n : (k + 1) * n], now):
                self._in_w += 1
                self.stats["frames_in"] += 1
            else:
                self.stats["ring_full"] += 1
        self._tail = a[whole * n :].copy()

    def caller_ring(self, on_close: Callable[[], None]) -> CallerRing:
        """The session's caller ring, for a writer outside Python (agent/audio_in/audio_pump.py) that takes
        over from `push_audio` (not to be used after this). `on_close` runs when the session closes, before
        its memory is unmapped: the writer must stop there."""
        if self._closed:
            raise EngineClosed(f"session {self.id} is closed")
        self._on_close.append(on_close)
        self._in_w = self._link.get(IN_W)
        return self._link.caller_ring()

    def submit_tool_result(self, call_id: str, output: str, is_error: bool = False) -> None:
        self._send(SubmitResult(str(call_id), str(output), bool(is_error)))

    def force_text(self, tokens: list[int] | str) -> None:
        self._send(ForceTokens("text", tuple(self._ids(tokens))))

    def force_function(self, tokens: list[int] | str) -> None:
        self._send(ForceTokens("function", tuple(self._ids(tokens))))

    def pad_between(self, on: bool = True) -> None:
        self._send(PadBetween(bool(on)))

    def keep_private(self, *terms: str) -> None:
        self._send(KeepPrivate(tuple(t for t in terms if isinstance(t, str))))

    def report_playout(
        self,
        queued_s: float,
        gaps: int,
        gap_s: float,
        start_delay_s: float,
        turn_played_at: float = 0.0,
        late_absorbed: int = 0,
    ) -> None:
        """The room's playout, for the engine's snapshot and /metrics (written to the session's shared memory,
        engine/transport/link.py PLAYOUT_FIELDS; nothing is sent)."""
        if not self._closed:
            figures = (queued_s, gaps, gap_s, start_delay_s, turn_played_at, late_absorbed)
            self._link.playout[:RECEIVE_AT] = figures

    def report_receive(self, jitter_s: float, concealed_s: float) -> None:
        """The room's receive side of the caller's audio (WebRTC's jitter buffer lately, the audio it
        concealed this call), for the engine's snapshot and /metrics: in the shared memory, as the playout."""
        if not self._closed:
            self._link.playout[RECEIVE_AT:] = (jitter_s, concealed_s)

    def _ids(self, tokens: list[int] | str) -> list[int]:
        return forced_ids(self._engine.tokens, tokens, self._engine.vocab_size)

    def _send(self, request: Request) -> None:
        if self._closed:
            return
        data = encode(request_message(request, self.id))
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(REQUEST_TIMEOUT_S)
            self._sock.sendall(data)
        except OSError:
            self._gone("the engine's connection failed")
        finally:
            if not self._closed:
                self._sock.setblocking(False)

    def close(self) -> None:
        """End the session: the engine frees the slot when the connection closes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._detach()

    def _detach(self) -> None:
        for stop in self._on_close:  # writers outside Python stop before the memory goes
            try:
                stop()
            except Exception:
                log.exception("session %s: a caller-ring writer did not stop cleanly", self.id)
        self._on_close.clear()
        with contextlib.suppress(Exception):  # closing: a loop already closed has no reader to remove
            self._loop.remove_reader(self._sock.fileno())
        with contextlib.suppress(Exception):  # closing: as above
            self._loop.remove_reader(self._efd)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.close(self._efd)
        self._link.close()

    # -- what the engine sends ----------------------------------------------------------------------------

    def _on_socket(self) -> None:
        if self._closed:
            return
        try:
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError:
            data = b""
        if data == b"":
            self._on_frames()  # what the tick wrote before the end
            self._gone("the engine ended the session")
            return
        if data:
            self._rx += data
        while (end := self._rx.find(b"\n")) >= 0:
            line = bytes(self._rx[:end])
            del self._rx[: end + 1]
            self._message(line)
        self._dispatch()

    def _message(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "event":
            event = decode_event(msg)
            seq, frames = msg.get("seq"), msg.get("frames")
            if event is not None and type(seq) is int and type(frames) is int:
                self._events[seq] = (frames, event)
        elif op == "drain" and self._engine.on_drain is not None:
            self._engine.on_drain(float(msg.get("seconds", 0.0)))
        elif op == "refused":
            self.stats["refused"] += 1
            log.warning("session %s: the engine refused a message (%s)", self.id, str(msg.get("why"))[:200])

    def read_frames(self) -> None:
        """Hand over now what the ring holds. (The engine wakes this loop for each frame of a turn, but for
        the silence between turns only once per engine/door/host_conn.py QUIET_WAKE frames.)"""
        self._dispatch()

    def _on_frames(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self._efd)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand the outputs over in the tick's order: frames and events, each after what came before it."""
        link, put = self._link, self.outputs.put_nowait
        frames = link.layout.out_frames
        while not self._closed:
            event = self._events.get(self._next_event)
            if event is not None and event[0] <= self._out_r:
                del self._events[self._next_event]
                self._next_event += 1
                put(event[1])
                continue
            w = link.get(OUT_W)
            if self._out_r >= w:
                break
            if w - self._out_r > frames:  # overwritten before this room read them
                self.stats["frames_lost"] += w - self._out_r - frames
                self._out_r = w - frames
            if link.events_before(self._out_r) >= self._next_event:
                break  # an event before this frame is still on its way
            record = link.read_agent(self._out_r)
            if record is None:
                continue  # overwritten while it was read: counted on the next pass
            self._out_r += 1
            link.set(OUT_R, self._out_r)
            self.stats["frames_out"] += 1
            put(AudioFrame(*record))

    def _gone(self, why: str) -> None:
        if self._closed:
            return
        self._dispatch()
        left = [e for _, (_, e) in sorted(self._events.items())]
        for e in left:  # events whose frames never came
            self.outputs.put_nowait(e)
        if not any(isinstance(e, SessionFailed) for e in left):
            self.outputs.put_nowait(SessionFailed(-1, why))
        self._events.clear()
        self._closed = True
        self._detach()
