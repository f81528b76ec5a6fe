"""A call's caller audio on the native path (agent/audio_in/audio_pump.py): livekit-agents' room input follows
the caller's microphone track as always (who is linked, a rejoin, a new track), but each track it picks
becomes a `NativeStream`, whose frames never reach Python. The frames that come before the engine's slot is
open are held in the callback (up to HELD_S, the oldest dropped and counted) and written in order once it
opens (`CallerAudio.attach`). Its counters go in the call's end line (agent/room.py). Knows livekit-agents'
room input (the version agent/audio_in names) and agent/audio_in/audio_pump.py; nothing of tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
from typing import Any

from livekit.agents.utils import aio

from agent.audio_in.audio_pump import STATS, NativeStream, PumpUnavailable
from engine.api import EngineError

log = logging.getLogger("chorus.agent.caller_input")

HELD_S = 30.0  # caller audio held before the engine's slot opens (as agent/duplex.py holds it)
_state: dict[str, bool] = {}

# the call whose room input is being made (agent/call.py sets it around `session.start`)
_making: contextvars.ContextVar[CallerAudio | None] = contextvars.ContextVar(
    "chorus_caller_audio", default=None
)


class CallerAudio:
    """One call's native caller audio: the room input's streams, the session's ring once the slot is open,
    and their counters summed over every track the call had."""

    def __init__(
        self, lib: ctypes.CDLL, *, rate: int, frame: int, loud: float, frame_ms: int, lead_s: float
    ) -> None:
        self._lib, self.rate, self.frame, self.loud = lib, rate, frame, loud
        self.lead_s = lead_s  # how far ahead of the ticks the frames end (audio_pump.c `align`; 0: off)
        self.hold = max(1, int(HELD_S * 1000 / frame_ms))
        self.stream: NativeStream | None = None
        self._ring: Any = None
        self._past = dict.fromkeys(STATS, 0.0)

    @contextlib.contextmanager
    def making_input(self):
        """While the framework's room input is made: it takes this call's native streams."""
        token = _making.set(self)
        try:
            yield
        finally:
            _making.reset(token)

    def open_stream(self, track: Any) -> NativeStream:
        stream = NativeStream.open(self._lib, track, self.rate, self.frame, self.loud, self.hold)
        self.stream = stream
        if self._ring is not None:
            self._attach(stream)
        return stream

    def attach(self, handle: Any) -> None:
        """The session's slot is open: its caller ring takes the held frames and every frame after them (a
        session already closed has none: the frames stay held, and go nowhere)."""
        try:
            self._ring = handle.caller_ring(on_close=self.detach)
        except EngineError as e:
            log.warning("session %s: the caller's audio has no ring: %s", handle.id, e)
            return
        if self.stream is not None and not self.stream.closed.is_set():
            self._attach(self.stream)

    def _attach(self, stream: NativeStream) -> None:
        try:
            stream.attach(self._ring, self.lead_s)
        except PumpUnavailable:
            log.exception("the caller's audio could not reach the session's ring")

    def detach(self) -> None:
        """(The session closes: its memory is about to be unmapped.) Frames are held again, and go nowhere."""
        self._ring = None
        if self.stream is not None:
            self.stream.detach()

    def closed_stream(self, stream: NativeStream) -> None:
        """Keep a closed stream's counters (the call's figures are summed over its tracks)."""
        for k, v in stream.stats().items():
            if k != "voiced_at":
                self._past[k] += v
            else:
                self._past[k] = max(self._past[k], v)
        if self.stream is stream:
            self.stream = None

    def stats(self) -> dict[str, float]:
        now = self.stream.stats() if self.stream is not None else {}
        out = dict(self._past)
        for k, v in now.items():
            out[k] = max(out[k], v) if k == "voiced_at" else out[k] + v
        return out

    @property
    def voiced_at(self) -> float:
        """When the caller's last loud frame came (time.monotonic; -1e9: none yet)."""
        v = self.stats().get("voiced_at", 0.0)
        return v if v > 0 else -1e9


def install_room_input() -> bool:
    """Make livekit-agents' room audio input native for a call being made under `CallerAudio.making_input`
    (any other input is the framework's own). Idempotent; False if the framework is not the one expected."""
    from livekit.agents.voice.room_io import _input, room_io

    if "room_input" in _state:
        return _state["room_input"]
    base = _input._ParticipantAudioInputStream
    ok = all(hasattr(base, name) for name in ("_create_stream", "_forward_task", "_close_stream"))
    if not ok or getattr(room_io, "_ParticipantAudioInputStream", None) is not base:
        log.warning("livekit-agents' room input is not the one expected: caller audio goes through Python")
        _state["room_input"] = False
        return False

    class NativeRoomInput(base):
        """The framework's room audio input, each of its streams a `NativeStream`: it follows the linked
        caller's tracks as the framework's does, and yields no frames (they go straight to the engine)."""

        def __init__(self, room: Any, *, call: CallerAudio, **kwargs: Any) -> None:
            kwargs["auto_gain_control"] = False
            super().__init__(room, **kwargs)
            self._call = call

        def _create_stream(self, track: Any, participant: Any) -> Any:
            try:
                return self._call.open_stream(track)
            except Exception:  # this track's frames take the framework's path (its forwarding, push_audio)
                log.exception("the caller's track could not be read natively; its audio goes through Python")
                return super()._create_stream(track, participant)

        async def _forward_task(self, old_task, stream, track, publication, participant) -> None:
            if not isinstance(stream, NativeStream):
                await super()._forward_task(old_task, stream, track, publication, participant)
                return
            if old_task is not None:
                await aio.cancel_and_wait(old_task)
            try:
                await stream.closed.wait()
            finally:
                self._call.closed_stream(stream)

    def make(room: Any, **kwargs: Any) -> Any:
        call = _making.get()
        if call is None:
            return base(room, **kwargs)
        return NativeRoomInput(room, call=call, **kwargs)

    room_io._ParticipantAudioInputStream = make
    _state["room_input"] = True
    return True
