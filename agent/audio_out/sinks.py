"""Where the agent's voice lands: a WAV file written on the wall clock, a room's published audio track, or the
console's speaker (`lk agent console`). Knows audio files, LiveKit's rtc audio source and the console's audio
output; nothing of turns, sessions or the engine (agent/audio_out/playout_buffer.py decides what plays when).

A sink takes int16 mono chunks at its own rate with the moment each starts playing, and can cut the chunk now
playing (`Sink`); a call wires it into its room by what `CallSink` says of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import wave
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

import numpy as np
from livekit import rtc
from livekit.agents import io
from livekit.agents.cli.tcp_console import AGENT_SAMPLE_RATE as CONSOLE_SAMPLE_RATE

from agent.audio_in import audio_pump
from agent.audio_out.playout_buffer import Sink

log = logging.getLogger("chorus.agent.sinks")

ROOM_RATE = 48_000  # a room track's rate: WebRTC's Opus runs at 48 kHz


class CallSink(Sink, Protocol):
    """A sink as a call wires it (agent/call.py). In a room, `join` readies it (publishes its track, if it has
    one not yet published); `track_sid` is the room track the agent's words go out with (None: none). A sink
    `on_session_output` plays into the audio output the session starts with (the console's speaker, handed to
    `attach`), and the playout then takes that output's place; the others are the session's output."""

    track_sid: str | None
    on_session_output: bool

    async def join(self, room: rtc.Room) -> None: ...

    def attach(self, output: io.AudioOutput) -> None: ...


class _OwnOutput:
    """A sink with an output of its own (a file, a track): the playout is the session's audio output."""

    track_sid: str | None = None
    on_session_output = False

    async def join(self, room: rtc.Room) -> None:
        pass

    def attach(self, output: io.AudioOutput) -> None:
        raise TypeError(f"{type(self).__name__} plays into its own output, not the session's")


class WavSink(_OwnOutput):
    """A room's loudspeaker as a file: audio lands at its play time on the wall clock, silence in between."""

    def __init__(self, path: str | Path, sample_rate: int) -> None:
        self.path = Path(path)
        self.sample_rate = sample_rate
        self._w = wave.open(str(self.path), "wb")  # noqa: SIM115 (open for the sink's lifetime)
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(sample_rate)
        self._t0 = time.monotonic()
        self._written = 0  # samples committed to the file
        self._cur: np.ndarray | None = None  # the chunk now playing, kept until it is over (it may be cut)
        self._cur_at = 0  # its first sample's position
        self.closed = False

    def _pos(self, t: float) -> int:
        return max(0, int(round((t - self._t0) * self.sample_rate)))

    def _commit(self) -> None:
        if self._cur is not None:
            self._w.writeframes(self._cur.tobytes())
            self._written += self._cur.size
            self._cur = None

    def _fill(self, upto: int) -> None:
        if upto > self._written:
            self._w.writeframes(np.zeros(upto - self._written, np.int16).tobytes())
            self._written = upto

    async def write(self, samples: np.ndarray, at: float) -> None:
        self._commit()
        self._fill(self._pos(at))
        self._cur, self._cur_at = samples, self._written

    def cut(self, at: float) -> None:
        if self._cur is not None:
            self._cur = self._cur[: max(0, self._pos(at) - self._cur_at)]

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._commit()
            self._fill(self._pos(time.monotonic()))
            self._w.close()


class RoomSink(_OwnOutput):
    """A room's loudspeaker: the agent's audio track (published by `start`), fed just in time. The track never
    falls silent by going quiet on the wire: while nothing has been written for IDLE_FILL_S (the prompt's
    prefill, a pause between turns) it carries 1 s frames of silence, as a phone line carries its hiss,
    so a caller's jitter buffer never runs dry and restarts. Speech never waits behind that silence: the
    first frame written after it drops what is still queued of it. (Each capture is a request to the rtc
    runtime and a callback back, on the room's loop: one a second while idle.) The source's
    queue holds QUEUE_MS, so a capture made with at most half a filler frame queued is taken at once and
    never holds up the speech behind it.

    `takes`: the rate of the audio written to it (the engine's output rate). With the native captures
    (agent/audio_in/audio_pump.py) it takes that rate and resamples to the track's in C, so the framework has
    nothing to resample; without them it takes the track's rate (`sample_rate` says which), and the framework
    resamples the session's frames to it."""

    IDLE_FILL_S = 0.06
    FILL_FRAME_S = 1.0
    QUEUE_MS = 2000  # above a filler frame and a half: the runtime takes such a capture at once
    # a capture the rtc runtime has not taken this long after it was due is given up (and counted), so a
    # stalled runtime costs the call that audio, never the rest of its turns
    CAPTURE_WAIT_S = 2.0
    # the speech's first capture waits this long at most for the filler's captures still on their way to the
    # source's queue: one the runtime takes after the clear would queue a whole filler frame of silence ahead
    # of every word for the rest of the call (seen: a room whose caller heard the agent 1 s late throughout)
    SETTLE_S = 0.05
    PUBLISH_TRIES = 3
    UNPUBLISH_WAIT_S = 2.0  # the server's answer to the track's unpublishing at the call's end

    def __init__(self, takes: int | None = None) -> None:
        self.sample_rate = ROOM_RATE  # the rate written to it (below: `takes`, when the captures are native)
        self.source = rtc.AudioSource(ROOM_RATE, 1, queue_size_ms=self.QUEUE_MS)
        self._ends = 0.0  # when the audio handed to the source so far has played (time.monotonic)
        self._spoken = 0.0  # when the last audio written (not filled) has played
        self._filler: asyncio.Task | None = None
        self._one_at_a_time = asyncio.Lock()  # the filler's silence and the speech never capture at once
        self._silence_queued = False  # the last capture was the filler's: what is queued is silence
        self.track_sid: str | None = None  # the published track's, once `start` has published it
        self._room: rtc.Room | None = None  # the room it was published in
        self._stalls = 0  # captures given up after CAPTURE_WAIT_S
        self._unsettled = 0  # the filler's silence still on its way when the speech cleared the queue
        self.subscriptions = 0  # the room's participants that have subscribed to the track so far
        self._subscribed = asyncio.Event()  # set at each subscription
        # the captures made natively, their answers taken off the room's loop (agent/audio_in/audio_pump.py),
        # when this process has the native callback
        self._native: audio_pump.TrackCapture | None = None
        lib = audio_pump.installed()
        if lib is not None:
            try:
                self._native = audio_pump.TrackCapture(lib, self.source, self.CAPTURE_WAIT_S, takes)
                self.sample_rate = self._native.rate
            except audio_pump.PumpUnavailable as e:
                log.warning("the agent's track is fed through Python: %s", e)

    @property
    def stalls(self) -> int:
        """Captures the rtc runtime took longer than CAPTURE_WAIT_S to answer, or refused, and turns whose
        speech found the filler's silence not yet taken after SETTLE_S."""
        if self._native is None:
            return self._stalls
        n = self._native.stats()
        answers = n.get("slow", 0) + n.get("refused", 0) + n.get("errors", 0)
        return self._stalls + self._unsettled + int(answers)

    async def join(self, room: rtc.Room) -> None:
        """The track published, unless it is already (a phone call's is, while it rings)."""
        if self.track_sid is None:
            await self.start(room)

    async def start(self, room: rtc.Room) -> None:
        """Publish the track; a server too busy to answer in time is asked again (PUBLISH_TRIES in all)."""
        opts = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        room.on("local_track_subscribed", self._on_subscribed)  # before: the first may follow at once
        for attempt in range(1, self.PUBLISH_TRIES + 1):
            track = rtc.LocalAudioTrack.create_audio_track("chorus-agent", self.source)
            try:
                publication = await room.local_participant.publish_track(track, opts)
                break
            except rtc.participant.PublishTrackError as e:
                if attempt == self.PUBLISH_TRIES or not room.isconnected():
                    raise
                log.warning("the agent's track was not published (%s); trying again", e)
        self.track_sid, self._room = publication.sid, room
        room.on("local_track_republished", self._republished)
        self._unpublish_on_leaving(room)
        self._filler = asyncio.create_task(self._fill())

    def _unpublish_on_leaving(self, room: rtc.Room) -> None:
        """Leaving the room takes the track out of it first. A call closes this sink before its room is left
        as a rule, but livekit-agents leaves a job's room before it runs the job's shutdown callbacks, and
        cancels an entrypoint that takes more than 15 s to end: a sink closed there finds the room gone and
        cannot unpublish its track, which the runtime then keeps (`_unpublish`). Every way out of the room
        goes through `room.disconnect`, so the room's own method does it."""
        leave = room.disconnect

        async def disconnect(*, reason: int = rtc.DisconnectReason.CLIENT_INITIATED) -> None:
            await self._unpublish()
            await leave(reason=reason)

        room.disconnect = disconnect  # type: ignore[method-assign]

    def _on_subscribed(self, track: rtc.LocalTrack) -> None:
        if self.track_sid is None or track.sid == self.track_sid:  # none yet: the answer is on its way
            self.subscriptions += 1
            self._subscribed.set()

    async def heard_by(self, room: rtc.Room, kinds: Collection[int], timeout: float) -> bool:
        """Whether, within `timeout` seconds, as many of the room's participants have subscribed to the track
        as there are participants of `kinds` (the callers) in it (the server says so once a subscriber's
        connection takes the track's packets): the caller can hear it. Other agents are not counted: one
        leaving need not subscribe (a draining agent was seen not to)."""
        try:
            async with asyncio.timeout(timeout):
                while self.subscriptions < sum(p.kind in kinds for p in room.remote_participants.values()):
                    self._subscribed.clear()
                    await self._subscribed.wait()
        except TimeoutError:
            return False
        return True

    def _republished(self, publication: rtc.LocalTrackPublication, previous_sid: str) -> None:
        """The rtc SDK's full reconnect published the track again, under a new id."""
        if previous_sid == self.track_sid:
            self.track_sid = publication.sid

    async def _capture(self, samples: np.ndarray, *, silence: bool = False) -> None:
        async with self._one_at_a_time:
            if self._silence_queued and not silence:  # speech goes out now, not after the idle silence
                if self._native is not None and not await self._native.answered(self.SETTLE_S):
                    self._unsettled += 1
                self.source.clear_queue()
                self._ends = time.monotonic()
            self._silence_queued = silence
            self._ends = max(time.monotonic(), self._ends) + samples.size / self.sample_rate
            if self._native is not None:
                self._native.capture(samples)  # answered off this loop; a refusal is counted there
                return
            frame = rtc.AudioFrame(samples.tobytes(), self.sample_rate, 1, samples.size)
            try:
                async with asyncio.timeout(self.CAPTURE_WAIT_S):  # a timer, not a task per capture
                    await self.source.capture_frame(frame)
            except TimeoutError:
                self._stalls += 1

    async def _fill(self) -> None:
        silence = np.zeros(int(self.sample_rate * self.FILL_FRAME_S), np.int16)
        while True:
            now = time.monotonic()
            idle_at = self._spoken + self.IDLE_FILL_S
            if now < idle_at:  # the agent is speaking: look again when it may have stopped
                await asyncio.sleep(idle_at - now)
                continue
            if self._ends <= now + self.FILL_FRAME_S / 2:
                await self._capture(silence, silence=True)  # idle: keep about one frame of silence queued
            await asyncio.sleep(max(0.005, self._ends - time.monotonic() - self.FILL_FRAME_S / 2))

    async def write(self, samples: np.ndarray, at: float) -> None:
        await self._capture(samples)
        self._spoken = self._ends

    def cut(self, at: float) -> None:
        self.source.clear_queue()
        self._ends = self._spoken = time.monotonic()

    async def aclose(self) -> None:
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filler
        if self._native is not None:
            self._native.close()
        await self._unpublish()
        await self.source.aclose()

    async def _unpublish(self) -> None:
        """Take the track out of the room while the agent is still in it. The rtc runtime (the version
        agent/audio_in names) keeps a track's native sender and its buffers for good when the room is left
        with the track still published: about 0.25 MB a call, a worker's memory growing call after call
        (measured: RSS flat over 60 publish-leave cycles with this, +13 MB without)."""
        room, sid = self._room, self.track_sid
        self._room = None
        if room is None or sid is None or not room.isconnected():
            return
        try:
            async with asyncio.timeout(self.UNPUBLISH_WAIT_S):
                await room.local_participant.unpublish_track(sid)
        except (rtc.participant.UnpublishTrackError, TimeoutError) as e:
            log.info("the agent's track was not unpublished (%s)", type(e).__name__)


class ConsoleSink:
    """The console's speaker (`lk agent console`), fed by the playout as a room's track is. The console puts
    its own audio output on the session when the session starts; `start_call` then plays into that output
    through this sink and puts the playout back in front, so a developer hears what a caller hears."""

    track_sid = None  # the agent's words stay in the console (its transcript sync passes them to nothing)
    on_session_output = True

    def __init__(self, sample_rate: int = CONSOLE_SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate
        self.speaker: io.AudioOutput | None = None

    async def join(self, room: rtc.Room) -> None:
        pass

    def attach(self, output: io.AudioOutput) -> None:
        """Play into the far end of `output`'s chain (the console's speaker, past its transcript sync)."""
        while output.next_in_chain is not None:
            output = output.next_in_chain
        if output.sample_rate not in (None, self.sample_rate):
            raise ValueError(f"console: its speaker plays {output.sample_rate} Hz, not {self.sample_rate} Hz")
        self.speaker = output

    async def write(self, samples: np.ndarray, at: float) -> None:
        if self.speaker is not None:
            frame = rtc.AudioFrame(samples.tobytes(), self.sample_rate, 1, samples.size)
            await self.speaker.capture_frame(frame)

    def cut(self, at: float) -> None:
        if self.speaker is not None:
            self.speaker.clear_buffer()

    async def aclose(self) -> None:
        self.speaker = None
