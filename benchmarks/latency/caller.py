"""A caller of the echo-latency benchmark: a real participant (the `livekit` rtc SDK) publishing a tone of its
own with 20 ms bursts, recording what comes back, and reading its own record: when each burst's onset left it,
when each echo arrived and which burst it is, and whether it heard its own tone. Knows nothing of the engine's
side of a burst (timing.py matches the two) nor of the worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from agent.audio_in.receive_stats import every_stat, inbound_audio, window
from testkit.callers import join_with_microphone, leave_room
from testkit.server import Server, token

RATE = 48_000  # the callers' tracks, both ways
# each caller's own tone (full scale 1.0), standing for a room's noise between words: well below the mark,
# never silence to the engine, and below speech (agent/duplex.py VOICE_RMS: its RMS is 0.014), as a caller's
# pauses are: the room's caller audio may leave such pieces out to cut its frames just ahead of the ticks
TONE = 0.02
BURST = 0.7  # the bursts' level, well above it
BURST_HZ = 1000.0
# a burst's length names it among four (burst i has LENGTHS_S[i % 4]), so that a burst is matched to its own
# echo even when the latency grows past the time between bursts
LENGTHS_S = (0.015, 0.030, 0.045, 0.060)
PERIOD_S = 0.5  # a burst every 0.45 to 0.55 s: its onset falls anywhere in the engine's 80 ms frames
# a caller this far behind the wall clock skips ahead (as a microphone would) instead of bursting
LATE_S = 0.1
QUIET_S = 0.1  # a received onset follows at least this long without a loud sample
SEND_MS = 40  # audio handed to the SDK at a time (each burst's place in its frame is counted)
RECV_MS = 40  # the agent's audio read in frames of this length (the SDK assembles them from 10 ms pulls)


@dataclass
class Caller:
    """A participant publishing its tone with bursts and recording the agent's audio."""

    server: Server
    room: str
    agent_name: str
    index: int
    rng: np.random.Generator
    tone: float = TONE
    freq: float = 0.0
    # sent: the first sample of each SEND_MS frame, its capture time and the SDK's queue before it
    sent_n: list[int] = field(default_factory=list)
    sent_t: list[float] = field(default_factory=list)
    sent_q: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)  # how late each frame was captured (the loop's load)
    bursts: list[int] = field(default_factory=list)  # sample index of each burst's onset
    skipped_ahead: int = 0  # times the sender fell LATE_S behind and skipped ahead
    heard: list[np.ndarray] = field(default_factory=list)
    heard_t: list[float] = field(default_factory=list)
    # the caller's WebRTC receive side of the agent's track (libwebrtc's NetEQ), read at the measurement's
    # start and end (`receive_stats`)
    rx: list[dict] = field(default_factory=list)
    agent_joined: asyncio.Event = field(default_factory=asyncio.Event)
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.freq = 330.0 + 45.0 * self.index
        self.jwt = token(self.server, self.room, f"caller-{self.index}", self.agent_name)

    async def join(self) -> None:
        from livekit import rtc

        self.lk = rtc.Room()

        def on_participant(p) -> None:
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                self.agent_joined.set()

        def on_track(track, _pub, _p) -> None:
            if track.kind == rtc.TrackKind.KIND_AUDIO:
                self.tasks.append(asyncio.ensure_future(self._record(track)))

        self.lk.on("participant_connected", on_participant)
        self.lk.on("track_subscribed", on_track)
        self.source = await join_with_microphone(self.lk, self.server, self.jwt, on_participant, 100)

    async def _record(self, track) -> None:
        from livekit import rtc

        loop = asyncio.get_running_loop()
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1, frame_size_ms=RECV_MS):
            self.heard_t.append(loop.time())
            self.heard.append(np.frombuffer(ev.frame.data, dtype=np.int16).copy())
            self.first_audio.set()

    def _frame(self, n: int, f: int, measuring: bool) -> np.ndarray:
        t = (n + np.arange(f)) / RATE
        x = self.tone * np.sin(2 * np.pi * self.freq * t)
        while measuring and 0 <= self._next < n + f:  # the bursts that begin in this frame
            self.bursts.append(max(self._next, n))
            self._next = self.bursts[-1] + int(PERIOD_S * RATE * self.rng.uniform(0.9, 1.1))
        for i in range(max(0, len(self.bursts) - 2), len(self.bursts)):
            b, length = self.bursts[i], int(LENGTHS_S[i % len(LENGTHS_S)] * RATE)
            lo, hi = max(b, n), min(b + length, n + f)
            if lo < hi:
                j = np.arange(lo, hi)
                x[lo - n : hi - n] += BURST * np.cos(2 * np.pi * BURST_HZ * (j - b) / RATE)
        return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)

    async def send(self, measure: asyncio.Event, stop: asyncio.Event) -> None:
        """Publish in real time on the wall clock; bursts while `measure` is set."""
        from livekit import rtc

        loop = asyncio.get_running_loop()
        f = RATE * SEND_MS // 1000
        t0, n = loop.time(), 0
        self._next = -1
        while not stop.is_set():
            due = t0 + n / RATE
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -LATE_S:
                t0, due = t0 - wait, due - wait
                self.skipped_ahead += 1
            if measure.is_set() and self._next < 0:
                self._next = n + int(self.rng.uniform(0, PERIOD_S) * RATE)
            pcm = self._frame(n, f, measure.is_set())
            now = loop.time()
            self.sent_n.append(n)
            self.sent_t.append(now)
            self.sent_q.append(self.source.queued_duration)
            self.late.append(now - due)
            await self.source.capture_frame(rtc.AudioFrame(pcm.tobytes(), RATE, 1, f))
            n += f

    async def read_receive(self) -> None:
        """Append the receive side's cumulative counters of the agent's audio (`inbound_audio`)."""
        try:
            stats = await self.lk.get_rtc_stats()
        except RuntimeError:  # the room is gone
            return
        self.rx.append(inbound_audio(every_stat(stats)))

    def receive_stats(self) -> dict:
        """What the caller's jitter buffer did over the measurement (agent/audio_in/receive_stats.py
        `window`)."""
        return window(self.rx[0], self.rx[-1]) if len(self.rx) >= 2 else {}

    async def leave(self) -> None:
        await leave_room(self.lk, self.tasks)

    # -- analysis ---------------------------------------------------------------------------------------

    def leave_times(self) -> np.ndarray:
        """When each burst's onset left this caller (monotonic seconds)."""
        starts = np.asarray(self.sent_n)
        k = np.searchsorted(starts, np.asarray(self.bursts), side="right") - 1
        return (
            np.asarray(self.sent_t)[k]
            + np.asarray(self.sent_q)[k]
            + (np.asarray(self.bursts) - starts[k]) / RATE
        )

    def heard_onsets(self, mark: float) -> tuple[np.ndarray, np.ndarray]:
        """When each burst's onset reached this caller, and which burst it is. The SDK hands over RECV_MS
        frames assembled from 10 ms pulls of the jitter buffer, so a frame's first sample arrived
        RECV_MS - 10 ms before the frame."""
        if not self.heard:
            return np.zeros(0), np.zeros(0, np.int64)
        audio = np.concatenate(self.heard).astype(np.float32) / 32768
        sizes = np.array([h.size for h in self.heard])
        first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        loud = np.flatnonzero(np.abs(audio) > mark)
        if not loud.size:
            return np.zeros(0), np.zeros(0, np.int64)
        onsets = loud[np.concatenate([[True], np.diff(loud) > QUIET_S * RATE])]
        span = int((max(LENGTHS_S) + 0.02) * RATE)
        names = np.array(
            [
                burst_name(
                    int((np.abs(audio[m : m + span]) > mark).sum()),
                    float(np.abs(audio[m : m + span]).max()),
                    RATE,
                    mark,
                )
                for m in onsets
            ]
        )
        j = np.searchsorted(first, onsets, side="right") - 1
        self._audio, self._onsets = audio, onsets
        return np.asarray(self.heard_t)[j] - (RECV_MS - 10) / 1000 + (onsets - first[j]) / RATE, names

    def tone_check(self) -> dict:
        """The tone this caller hears between bursts (its own?), and how continuous it is: 10 ms blocks of the
        echoed audio quieter than a third of the tone, over the measurement."""
        audio, onsets = getattr(self, "_audio", None), getattr(self, "_onsets", None)
        if audio is None or onsets is None or onsets.size < 2:
            return {"freq_hz": None, "own_tone": False, "quiet_blocks": None, "longest_quiet_ms": None}
        seg = audio[onsets[0] + int(0.05 * RATE) : onsets[0] + int(0.40 * RATE)]
        spec = np.abs(np.fft.rfft(seg * np.hanning(seg.size)))
        freq = float(np.argmax(spec) * RATE / seg.size)
        span = audio[onsets[0] : onsets[-1]]
        block = RATE // 100
        rms = np.sqrt(np.mean(span[: span.size // block * block].reshape(-1, block) ** 2, axis=1))
        quiet = rms < self.tone / np.sqrt(2) / 3
        longest, run = 0, 0
        for q in quiet:
            run = run + 1 if q else 0
            longest = max(longest, run)
        return {
            "freq_hz": round(freq, 1),
            "own_tone": abs(freq - self.freq) < 10,
            "quiet_blocks": int(quiet.sum()),
            "blocks": int(quiet.size),
            "longest_quiet_ms": 10 * longest,
        }


def burst_name(loud: int, peak: float, rate: int, mark: float) -> int:
    """Which of LENGTHS_S a burst is, from how many of its samples are above the mark: a cosine of amplitude A
    is above `mark` for 1 - 2/pi asin(mark / A) of its samples."""
    share = 1 - 2 / np.pi * np.arcsin(min(1.0, mark / max(peak, 1e-9)))
    length = loud / rate / max(share, 1e-9)
    return int(np.argmin([abs(length - x) for x in LENGTHS_S]))
