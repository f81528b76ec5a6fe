"""A real LiveKit server for the end-to-end tests: the server `scripts/livekit.sh` started, the worker run as
a user runs it (`python -m agent start`, a subprocess), and callers that are real WebRTC participants (the
`livekit` rtc SDK) publishing a caller WAV as a 48 kHz microphone track and recording what the
agent sends back.

The server and every participant run in a network namespace with no way out (scripts/livekit.sh, `netns_up`):
`require_livekit()` checks that first. Without a server the tests skip; under CI=true they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from agent.call import room_label

ROOT = Path(__file__).resolve().parent.parent
CALLERS = ROOT / "prompts" / "callers"
RATE = 48_000  # a browser's microphone track
FRAME = RATE // 20  # 50 ms handed to the SDK at a time (it sends 10 ms packets); fewer wake-ups per caller
RECV_MS = 80  # the agent's audio is read in 80 ms frames, one engine frame (gaps are judged at 200 ms)
SPEECH_PEAK = 300  # int16: the agent's speech peaks far above this; silence through WebRTC stays near 0
ALLOWED_INTERFACES = {
    "lo",
    "lkv0",
    "lkv1",
}  # scripts/livekit.sh: loopback and the veth pair with both ends here


@dataclass(frozen=True)
class Server:
    url: str
    key: str
    secret: str

    @property
    def http_url(self) -> str:
        return self.url.replace("ws://", "http://").replace("wss://", "https://")


def interfaces() -> set[str]:
    """This network namespace's interfaces (from /sys, as `ip link` lists them)."""
    return set(os.listdir("/sys/class/net"))


def require_livekit() -> Server:
    """The test server from scripts/livekit.sh's start_livekit, in a namespace with no way out; else skip
    (fail under CI=true)."""
    miss = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    leaks = interfaces() - ALLOWED_INTERFACES
    if leaks:
        miss(
            f"this network namespace has interfaces that lead out of it: {sorted(leaks)} (scripts/livekit.sh)"
        )
    url = os.environ.get("CHORUS_TEST_LIVEKIT_URL")
    if not url:
        miss("no LiveKit server: run the suite as .ci/run does (scripts/livekit.sh: netns_up, start_livekit)")
    return Server(
        url, os.environ["CHORUS_TEST_LIVEKIT_API_KEY"], os.environ["CHORUS_TEST_LIVEKIT_API_SECRET"]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def token(server: Server, room: str, identity: str, agent_name: str | None = None, metadata: str = "") -> str:
    """A caller's join token; with `agent_name` the room dispatches that agent when the caller joins (as
    `python -m agent token` makes them), with `metadata` as the job's metadata."""
    from livekit import api

    t = (
        api.AccessToken(server.key, server.secret)
        .with_identity(identity)
        .with_grants(api.VideoGrants(room_join=True, room=room))
    )
    if agent_name:
        dispatch = api.RoomAgentDispatch(agent_name=agent_name, metadata=metadata)
        t = t.with_room_config(api.RoomConfiguration(agents=[dispatch]))
    return t.to_jwt()


class Worker:
    """`python -m agent start` against the test server: tiny preset, its own agent name, SQLite store and
    ports. Its output goes to `log`; `snapshot()` reads the engine's /snapshot and `info()`
    the worker's /worker."""

    def __init__(self, server: Server, tmp: Path, *, slots: int = 4, name: str | None = None, **env: str):
        self.server, self.slots = server, slots
        self.agent_name = name or f"chorus-test-{uuid.uuid4().hex[:8]}"
        self.metrics_port, self.http_port = free_port(), free_port()
        self.log = tmp / f"worker-{self.agent_name}-{self.http_port}.log"
        self.env = {
            **os.environ,
            "LIVEKIT_URL": server.url,
            "LIVEKIT_API_KEY": server.key,
            "LIVEKIT_API_SECRET": server.secret,
            "LIVEKIT_AGENT_NAME": self.agent_name,
            "CHORUS_PRESET": "tiny",
            "CHORUS_DEVICE": "cpu",
            "CHORUS_SLOTS": str(slots),
            "CHORUS_METRICS_PORT": str(self.metrics_port),
            "CHORUS_HTTP_PORT": str(self.http_port),
            "CHORUS_DATA_DIR": str(tmp),
            "CHORUS_TEACHER_FORCING": "true",
            # these tests are of behaviour on a shared 2-core machine that also runs the server and the
            # callers; capacity is the benchmark's to measure
            "CHORUS_REFUSE_WHEN_OVERLOADED": "false",
            **env,
        }
        self.env.pop("DATABASE_URL", None)
        self.proc: subprocess.Popen | None = None

    def launch(self) -> Worker:
        """Start the worker's process (once) without waiting: workers launched together start at once."""
        if self.proc is None:
            self._out = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent", "start"],
                cwd=ROOT,
                env=self.env,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def start(self, timeout: float = 120.0) -> Worker:
        """Launch the worker if it is not yet, and wait until it has registered with the server."""
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError, ValueError):
                self.snapshot()
                if b"registered worker" in self.log.read_bytes():
                    return self
            time.sleep(0.2)
        raise AssertionError(f"the worker did not register within {timeout:.0f} s:\n{self.tail()}")

    def snapshot(self) -> dict:
        return get_json(f"http://127.0.0.1:{self.metrics_port}/snapshot")

    def info(self) -> dict:
        return get_json(f"http://127.0.0.1:{self.http_port}/worker")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if hasattr(self, "_out"):
            self._out.close()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def agent_sip(server: Server, *args: str, agent_name: str | None = None) -> subprocess.CompletedProcess:
    """`python -m agent sip ...` against the test server (for `agent_name`'s agent, when given)."""
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.key}
    env["LIVEKIT_API_SECRET"] = server.secret
    if agent_name:
        env["LIVEKIT_AGENT_NAME"] = agent_name
    return subprocess.run(
        [sys.executable, "-m", "agent", "sip", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
    sources: set[str] = field(default_factory=set)  # the participants whose audio tracks were heard
    agent_identity: str | None = None  # the room's first agent
    agents: set[str] = field(default_factory=set)  # every agent that joined the room (a lost one's successor)
    agent_joined_at: float | None = None
    audible_samples: int = 0  # samples received in frames that are not silence
    tracks: int = 0  # audio tracks subscribed

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

        from agent import rtc_ffi

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
                self._tasks.append(asyncio.ensure_future(self._record(track)))

        def on_text(reader: rtc.TextStreamReader, sender: str) -> None:
            async def consume() -> None:
                try:
                    text = await reader.read_all()
                except rtc.data_stream.StreamError:  # its sender left mid-stream (an agent gone)
                    return
                self.heard.transcripts.append((sender, text, dict(reader.info.attributes or {})))

            self._tasks.append(asyncio.ensure_future(consume()))

        self.room.on("participant_connected", on_participant)
        self.room.on("track_subscribed", on_track)
        self.room.register_text_stream_handler("lk.transcription", on_text)
        await self.room.connect(self.server.url, self.jwt)
        for p in self.room.remote_participants.values():
            on_participant(p)
        self.source = rtc.AudioSource(RATE, 1, queue_size_ms=200)
        track = rtc.LocalAudioTrack.create_audio_track("microphone", self.source)
        await self.room.local_participant.publish_track(track, self.publish_options())

    def publish_options(self):
        """How the microphone track is published: as a browser does (Opus, with RED)."""
        from livekit import rtc

        return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)

    async def _record(self, track) -> None:
        from livekit import rtc

        loop = asyncio.get_running_loop()
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1, frame_size_ms=RECV_MS):
            samples = np.frombuffer(ev.frame.data, dtype=np.int16).copy()
            self.heard.frames.append(samples)
            self.heard.times.append(loop.time())
            self.first_audio.set()
            if np.abs(samples).max(initial=0) > SPEECH_PEAK:  # each frame judged once, as it arrives
                self.heard.audible_samples += samples.size
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
        with contextlib.suppress(Exception):
            await self.room.disconnect()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _deadline(timeout: float, what: str):
    """Yields until `timeout` passes, then raises AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.1f} s")


def wait_until(predicate, timeout: float, every: float = 0.1, what: str = "the condition"):
    """Poll `predicate` until it returns a true value (returned) or `timeout` passes (AssertionError)."""
    for _ in _deadline(timeout, what):
        if value := predicate():
            return value
        time.sleep(every)


async def await_until(predicate, timeout: float, every: float = 0.1, what: str = "the condition"):
    """`wait_until` for a coroutine: the event loop goes on between polls."""
    for _ in _deadline(timeout, what):
        if value := predicate():
            return value
        await asyncio.sleep(every)


class SessionsByRoom(dict):
    """A snapshot's sessions by their label, looked up by room name: the worker shows a room by its label, a
    pseudonym of its name (agent/call.py, `room_label`), so a name is looked up by its label."""

    def __getitem__(self, room: str) -> dict:
        return super().__getitem__(room_label(room))

    def get(self, room: str, default=None):
        return super().get(room_label(room), default)

    def __contains__(self, room: object) -> bool:
        return super().__contains__(room_label(room) if isinstance(room, str) else room)


def sessions_by_label(snapshot: dict) -> SessionsByRoom:
    return SessionsByRoom({s["label"]: s for s in snapshot["sessions"]})
