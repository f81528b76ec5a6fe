"""Callers that are real WebRTC participants (the `livekit` rtc SDK): each joins a room with a token that
dispatches the agent, publishes a caller WAV as a 48 kHz microphone track, and records the agent's audio
and transcription text as it arrives. Knows nothing of the worker behind the room, nor of what a test or a
benchmark makes of what was heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testkit.server import ROOT, Server, token

CALLERS = ROOT / "prompts" / "callers"
RATE = 48_000  # a browser's microphone track
FRAME = RATE // 20  # 50 ms handed to the SDK at a time (it sends 10 ms packets); fewer wake-ups per caller
RECV_MS = 80  # the agent's audio is read in 80 ms frames, one engine frame (gaps are judged at 200 ms)
SPEECH_PEAK = 300  # int16: the agent's speech peaks far above this; silence through WebRTC stays near 0


async def join_with_microphone(room, server: Server, jwt: str, on_participant, queue_ms: int, options=None):
    """Connect `room` to `server` with `jwt`, show `on_participant` each participant already in it, and
    publish a microphone track at RATE (mono) with `options` (a microphone's by default): its audio source,
    whose queue holds `queue_ms`."""
    from livekit import rtc

    await room.connect(server.url, jwt)
    for p in room.remote_participants.values():
        on_participant(p)
    source = rtc.AudioSource(RATE, 1, queue_size_ms=queue_ms)
    track = rtc.LocalAudioTrack.create_audio_track("microphone", source)
    options = options or rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
    await room.local_participant.publish_track(track, options)
    return source


async def leave_room(room, tasks: list[asyncio.Task]) -> None:
    """Disconnect from `room` and stop `tasks` (what read its tracks)."""
    with contextlib.suppress(Exception):  # leaving: a room that lost its server cannot say goodbye
        await room.disconnect()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def caller_pcm(name: str = "caller_booking.wav", rate: int = RATE) -> np.ndarray:
    """A committed caller WAV (16 kHz) as int16 at `rate`, resampled linearly."""
    pcm, src = read_wav(CALLERS / name)
    n = int(round(pcm.size * rate / src))
    x = np.interp(np.arange(n) * src / rate, np.arange(pcm.size), pcm.astype(np.float64))
    return np.round(x).astype(np.int16)


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """int16 mono samples and the rate of a 16-bit mono WAV (read here: importing the agent's modules would
    stall a caller's event loop for as long as livekit-agents takes to import)."""
    with wave.open(str(path), "rb") as w:
        assert (w.getsampwidth(), w.getnchannels()) == (2, 1), path
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16), w.getframerate()


@dataclass
class Heard:
    """What a caller received from the agent: audio frames with their arrival times,
    and transcription text."""

    frames: list[np.ndarray] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # loop.time() at each frame's arrival
    transcripts: list[tuple[str, str, dict]] = field(default_factory=list)  # (sender, text, attributes)
    turns_at: list[tuple[str, float]] = field(default_factory=list)  # (sender, loop time) of each transcript
    sources: set[str] = field(default_factory=set)  # the participants whose audio tracks were heard
    agent_identity: str | None = None  # the room's first agent
    agents: set[str] = field(default_factory=set)  # every agent that joined the room (a lost one's successor)
    track_at: dict[str, float] = field(default_factory=dict)  # each participant's audio track subscribed
    audio_at: dict[str, float] = field(default_factory=dict)  # each participant's first frame (silence too)
    speech_at: dict[str, float] = field(default_factory=dict)  # each agent's first frame that is not silence
    last_speech_at: float | None = None  # the latest frame that is not silence, from any agent
    agent_joined_at: float | None = None
    audible_samples: int = 0  # samples received in frames that are not silence
    tracks: int = 0  # audio tracks subscribed
    track_sids: list[str] = field(default_factory=list)  # theirs, in order
    agents_left: list[str] = field(default_factory=list)  # why each agent that left did (a DisconnectReason)
    left_at: dict[str, float] = field(default_factory=dict)  # when each agent that left did (loop time)
    connection: list[str] = field(default_factory=list)  # the caller's own: reconnecting, reconnected, ...

    def summary(self) -> dict:
        """What a failed wait shows of one caller's reception: tracks, frames, their loudest sample, words."""
        peak = int(max((np.abs(f).max(initial=0) for f in self.frames), default=0))
        return {
            "agents": len(self.agents),
            "tracks": self.tracks,
            "frames": len(self.frames),
            "peak": peak,
            "audible_s": round(self.audible_s(), 2),
            "longest_gap_s": round(self.longest_gap(), 2),
            "words": [t for _, t, _ in self.transcripts],
            "agents_left": self.agents_left,
            "connection": self.connection,
        }

    def audio(self) -> np.ndarray:
        return np.concatenate(self.frames) if self.frames else np.zeros(0, np.int16)

    def audible_s(self) -> float:
        """Seconds of the received audio in frames that are not silence (speech, through WebRTC)."""
        return self.audible_samples / RATE

    def longest_gap(self) -> float:
        """The longest wait between two received frames after the first (seconds)."""
        return float(np.diff(self.times).max()) if len(self.times) > 1 else 0.0

    def gaps(self, over: float = 0.1) -> list[tuple[float, float]]:
        """(seconds after the first frame, length) of every wait between frames longer than `over`."""
        t = np.asarray(self.times)
        d = np.diff(t)
        return [(round(float(t[i] - t[0]), 2), round(float(d[i]), 3)) for i in np.flatnonzero(d > over)]

    def text(self) -> str:
        return " ".join(t for _, t, _ in self.transcripts)


def frames_heard() -> int:
    """Frames of the agent's audio every caller of this process has received: what a long run's watchdog
    (testkit/watchdog.py) sees move while any call is live. Read from its thread; it only reads."""
    return _heard[0]


_heard = [0]  # (a list: one int that the callers' tasks add to, with no lock: a lost count moves it anyway)


class Caller:
    """One caller: joins `room` with a token that dispatches `agent_name`, publishes a microphone track, and
    records the agent's audio and the `lk.transcription` text streams."""

    def __init__(
        self, server: Server, room: str, agent_name: str, identity: str = "caller", metadata: str = ""
    ):
        self.server, self.room_name, self.identity = server, room, identity
        self.jwt = token(server, room, identity, agent_name, metadata)
        self.heard = Heard()
        self.sent_samples = 0
        self.agent_joined = asyncio.Event()
        self.first_audio = asyncio.Event()  # any frame of the agent's track (silence too)
        self.first_speech = asyncio.Event()  # the first frame of the agent's track that is not silence
        self._tasks: list[asyncio.Task] = []

    async def join(self) -> None:
        from livekit import rtc

        from agent.audio_in import rtc_ffi

        # the callers' rooms share this process's FFI client as the worker's rooms share the worker's: routed,
        # and their events handed to the loop in batches (the SDK's own queue wakes the loop once per event)
        rtc_ffi.install()
        self.room = rtc.Room()
        loop = asyncio.get_running_loop()

        def on_participant(p: rtc.RemoteParticipant) -> None:
            if p.kind != rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                return
            self.heard.agents.add(p.identity)
            if self.heard.agent_identity is None:
                self.heard.agent_identity, self.heard.agent_joined_at = p.identity, loop.time()
                self.agent_joined.set()

        def on_track(track: rtc.Track, _pub, p: rtc.RemoteParticipant) -> None:
            if track.kind == rtc.TrackKind.KIND_AUDIO:
                self.heard.sources.add(p.identity)
                self.heard.tracks += 1
                self.heard.track_sids.append(track.sid)
                self.heard.track_at.setdefault(p.identity, loop.time())
                self._tasks.append(asyncio.ensure_future(self._record(track, p.identity)))

        def on_text(reader: rtc.TextStreamReader, sender: str) -> None:
            async def consume() -> None:
                try:
                    text = await reader.read_all()
                except rtc.data_stream.StreamError:  # its sender left mid-stream (an agent gone)
                    return
                self.heard.transcripts.append((sender, text, dict(reader.info.attributes or {})))
                self.heard.turns_at.append((sender, asyncio.get_running_loop().time()))

            self._tasks.append(asyncio.ensure_future(consume()))

        def on_participant_left(p: rtc.RemoteParticipant) -> None:
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                self.heard.agents_left.append(rtc.DisconnectReason.Name(p.disconnect_reason or 0))
                self.heard.left_at[p.identity] = loop.time()

        def on_connection(state: str):
            return lambda *args: self.heard.connection.append(
                " ".join([state, *(rtc.DisconnectReason.Name(a) for a in args if isinstance(a, int))])
            )

        self.room.on("participant_connected", on_participant)
        self.room.on("participant_disconnected", on_participant_left)
        for state in ("reconnecting", "reconnected", "disconnected"):
            self.room.on(state, on_connection(state))
        self.room.on("track_subscribed", on_track)
        self.room.register_text_stream_handler("lk.transcription", on_text)
        self.source = await join_with_microphone(
            self.room, self.server, self.jwt, on_participant, 200, self.publish_options()
        )

    def publish_options(self):
        """How the microphone track is published: as a browser does (Opus, with RED)."""
        from livekit import rtc

        return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)

    async def _record(self, track, source: str = "") -> None:
        from livekit import rtc

        loop = asyncio.get_running_loop()
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1, frame_size_ms=RECV_MS):
            samples = np.frombuffer(ev.frame.data, dtype=np.int16).copy()
            self.heard.frames.append(samples)
            self.heard.times.append(loop.time())
            _heard[0] += 1
            self.heard.audio_at.setdefault(source, loop.time())
            self.first_audio.set()
            if np.abs(samples).max(initial=0) > SPEECH_PEAK:  # each frame judged once, as it arrives
                self.heard.audible_samples += samples.size
                self.heard.speech_at.setdefault(source, loop.time())
                self.heard.last_speech_at = loop.time()
                self.first_speech.set()

    async def speak(self, pcm: np.ndarray, seconds: float | None = None) -> None:
        """Publish `pcm` in real time (`capture_frame` paces the frames), then silence up to `seconds`."""
        from livekit import rtc

        total = pcm.size if seconds is None else max(pcm.size, int(seconds * RATE))
        pcm = np.concatenate([pcm, np.zeros(total - pcm.size, np.int16)])
        for i in range(0, pcm.size - FRAME + 1, FRAME):
            frame = rtc.AudioFrame(pcm[i : i + FRAME].tobytes(), RATE, 1, FRAME)
            await self.source.capture_frame(frame)
            self.sent_samples += FRAME

    async def leave(self) -> None:
        await leave_room(self.room, self._tasks)
