"""The agent's voice on its way out: a paced 160 ms playout buffer, barge-in flushes, acknowledgement clips.

`PlayoutOutput` is the session's `io.AudioOutput`: it queues the model's audio (at most 160 ms, the first
frame of a turn starting 80 ms in to absorb tick jitter), plays it on a wall clock into a sink (a WAV file or
a room track), drops what is queued when the caller barges in, and fills a tool pause with a prerecorded clip
that never overlaps the model's speech. Knows livekit-agents' output contract and audio; nothing of models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import wave
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from livekit import rtc
from livekit.agents import io
from livekit.agents.utils import aio

from agent.duplex import CallObserver

log = logging.getLogger("chorus.agent.playout")

BUFFER_S = 0.160  # the playout buffer: audio queued ahead of the play head
START_DELAY_S = 0.080  # a turn's first frame waits this long, so one late tick does not leave a gap
CHUNK_S = 0.080  # clips are played in chunks of this length
LATE_HANDOVER_S = 0.02  # a chunk handed over this late still joins the one before (the sink's own slack)
ACK_FALLBACK_S = 0.5  # a clip waits at most this long for the interrupted turn's audio to arrive
ACKS_DIR = Path(__file__).resolve().parent.parent / "prompts" / "acks"
HISTORY = 1024  # playout events and spans kept per call (about 80 s of chunks)


# -- sinks ------------------------------------------------------------------------------------------------


class WavSink:
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


class RoomSink:
    """A room's loudspeaker: the agent's audio track (published by `start`), fed just in time. The track never
    falls silent by going quiet on the wire: while nothing has been written for IDLE_FILL_S (the prompt's
    prefill, a pause between turns) it carries 40 ms frames of silence, as a phone line carries its hiss, so a
    caller's jitter buffer never runs dry and restarts."""

    IDLE_FILL_S = 0.06
    FILL_FRAME_S = 0.04

    def __init__(self, sample_rate: int = 48_000) -> None:
        self.sample_rate = sample_rate
        self.source = rtc.AudioSource(sample_rate, 1, queue_size_ms=100)
        self._ends = 0.0  # when the audio handed to the source so far has played (time.monotonic)
        self._spoken = 0.0  # when the last audio written (not filled) has played
        self._filler: asyncio.Task | None = None

    async def start(self, room: rtc.Room) -> None:
        track = rtc.LocalAudioTrack.create_audio_track("chorus-agent", self.source)
        opts = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        await room.local_participant.publish_track(track, opts)
        self._filler = asyncio.create_task(self._fill())

    async def _capture(self, samples: np.ndarray) -> None:
        self._ends = max(time.monotonic(), self._ends) + samples.size / self.sample_rate
        await self.source.capture_frame(rtc.AudioFrame(samples.tobytes(), self.sample_rate, 1, samples.size))

    async def _fill(self) -> None:
        silence = np.zeros(int(self.sample_rate * self.FILL_FRAME_S), np.int16)
        while True:
            now = time.monotonic()
            idle_at = self._spoken + self.IDLE_FILL_S
            if now < idle_at:  # the agent is speaking: look again when it may have stopped
                await asyncio.sleep(idle_at - now)
                continue
            if self._ends <= now + self.FILL_FRAME_S / 2:
                await self._capture(silence)  # idle: keep about one frame of silence queued
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
        await self.source.aclose()


# -- acknowledgement clips ---------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _load_clips(directory: str, sample_rate: int) -> tuple[tuple[str, np.ndarray], ...]:
    clips = []
    for path in sorted(Path(directory).glob("*.wav")):
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{path.name}: acknowledgement clips must be 16-bit WAV")
            rate, ch = w.getframerate(), w.getnchannels()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        if ch > 1:
            pcm = pcm.reshape(-1, ch).mean(axis=1).astype(np.int16)
        if rate != sample_rate:
            rs = rtc.AudioResampler(rate, sample_rate, num_channels=1, quality=rtc.AudioResamplerQuality.HIGH)
            frames = rs.push(rtc.AudioFrame(pcm.tobytes(), rate, 1, pcm.size)) + rs.flush()
            pcm = np.concatenate([np.frombuffer(f.data, dtype=np.int16) for f in frames])
        clips.append((path.stem, pcm))
    return tuple(clips)


class AckClips:
    """Prerecorded "one moment" phrasings; `next()` never gives the same one twice in a row."""

    def __init__(self, sample_rate: int, directory: str | Path = ACKS_DIR, seed: int | None = None) -> None:
        self.clips = _load_clips(str(directory), sample_rate)
        if not self.clips:
            raise FileNotFoundError(f"no acknowledgement clips (*.wav) in {directory}")
        self._rng = random.Random(seed)
        self._last = -1

    def next(self) -> tuple[str, np.ndarray]:
        choices = [i for i in range(len(self.clips)) if i != self._last] or [0]
        self._last = self._rng.choice(choices)
        return self.clips[self._last]


# -- the output --------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    queued: int = 0  # chunks queued or playing
    played_s: float = 0.0
    started: bool = False
    flushed: bool = False
    cut: bool = False
    done: bool = False
    last_end: float = 0.0  # when its last chunk so far ends playing


@dataclass
class _Chunk:
    samples: np.ndarray
    kind: str  # "model" or "clip"
    seg: _Segment | None
    arrived: float = field(default_factory=time.monotonic)

    @property
    def duration(self) -> float:
        return self.samples.size / self._rate

    _rate: int = 22_050


class PlayoutOutput(io.AudioOutput, CallObserver):
    """The session's audio output and the duplex session's observer (see the module docstring)."""

    def __init__(
        self, sink: WavSink | RoomSink, *, acks: AckClips | None = None, label: str = "chorus"
    ) -> None:
        super().__init__(
            label=label, capabilities=io.AudioOutputCapabilities(pause=False), sample_rate=sink.sample_rate
        )
        self.sink = sink
        self.rate = sink.sample_rate
        self.acks = acks
        self._queue: deque[_Chunk] = deque()
        self._playing: _Chunk | None = None
        self._end = 0.0  # when the chunk now playing ends
        self._seg: _Segment | None = None  # the segment being captured
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._paused = False
        self._ack_on_flush = False
        self._ack_timer: asyncio.TimerHandle | None = None
        self.turns_started = self.turns_ended = 0  # the model's turns (see `after_next_turn`)
        # recent history for reports and tests, bounded: a call can last for hours
        self.events: deque[tuple[float, str]] = deque(maxlen=HISTORY)  # (monotonic time, what)
        self.spans: deque[list] = deque(maxlen=HISTORY)  # [kind, start, end] per chunk played, ends cut
        self.stats = {
            "model_s": 0.0,
            "clip_s": 0.0,
            "clips": 0,
            "cuts": 0,
            "flushed_s": 0.0,
            "segments": 0,
            "gaps": 0,
            "gap_s": 0.0,
            "dropped_s": 0.0,
        }

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._pace(), name="chorus.playout")

    def _note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    @property
    def queued_s(self) -> float:
        ahead = sum(c.samples.size for c in self._queue) / self.rate
        return ahead + max(0.0, self._end - time.monotonic()) if self._playing else ahead

    @property
    def clip_playing(self) -> bool:
        return (
            self._playing is not None and self._playing.kind == "clip" and self._end > time.monotonic()
        ) or any(c.kind == "clip" for c in self._queue)

    # -- io.AudioOutput --------------------------------------------------------------------------------

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        self.start()
        if self._seg is None:
            self._seg = _Segment()
            self.stats["segments"] += 1
            self.stop_clip()  # the model speaks again
        seg = self._seg
        if frame.samples_per_channel == 0:
            return
        if seg.cut:  # the rest of a turn the caller interrupted
            self.stats["dropped_s"] += frame.duration
            return
        if frame.sample_rate != self.rate:
            raise ValueError(f"playout: expected {self.rate} Hz frames, got {frame.sample_rate} Hz")
        pcm = np.frombuffer(frame.data, dtype=np.int16).copy()
        if frame.num_channels > 1:
            pcm = pcm.reshape(-1, frame.num_channels)[:, 0].copy()
        while self.queued_s + pcm.size / self.rate > BUFFER_S + 1e-6 and not seg.cut:
            self._space.clear()
            await self._space.wait()
        if seg.cut:
            self.stats["dropped_s"] += frame.duration
            return
        self._push(_Chunk(pcm, "model", seg, _rate=self.rate))

    def flush(self) -> None:
        super().flush()
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.flushed = True
            self._maybe_finish(seg)
        if self._ack_on_flush:
            self._start_ack()

    def clear_buffer(self) -> None:
        self.cut()
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.flushed = True
            self._maybe_finish(seg)

    # -- CallObserver ----------------------------------------------------------------------------------

    def on_turn_started(self) -> None:
        self.turns_started += 1
        self.stop_clip()

    def on_turn_ended(self, barge_in: bool) -> None:
        self.turns_ended += 1
        if barge_in:
            self.cut()

    async def after_next_turn(self, timeout: float) -> bool:
        """Until a turn the model starts from now on has ended and its audio has played (True), or `timeout`
        seconds (False): the moment a phone call may be handed over or hung up after the agent said so."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        started = self.turns_started
        while self.turns_started == started and loop.time() < until:
            await asyncio.sleep(0.05)
        if self.turns_started == started:
            return False
        while self.turns_ended < self.turns_started and loop.time() < until:
            await asyncio.sleep(0.05)
        await self.play_out(timeout=max(0.0, until - loop.time()))
        return self.turns_ended >= self.turns_started

    def on_tool_pause(self, after_speech: bool) -> None:
        self._note("pause")
        if self.acks is None:
            return
        self._paused = True
        if after_speech:
            # the turn the call cut short still reaches us through the framework: the clip follows its flush
            self._ack_on_flush = True
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_FALLBACK_S, self._start_ack)
        else:
            self._start_ack()

    def on_tool_resume(self) -> None:
        self._note("resume")
        self._paused = False
        self._ack_on_flush = False
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self.stop_clip()

    def _start_ack(self) -> None:
        self._ack_on_flush = False
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        if self._paused and self.acks is not None:
            name, pcm = self.acks.next()
            self.play_clip(pcm, name)

    # -- queue operations ------------------------------------------------------------------------------

    def _push(self, chunk: _Chunk) -> None:
        if chunk.seg is not None:
            chunk.seg.queued += 1
        self._queue.append(chunk)
        self._wake.set()

    def cut(self) -> None:
        """Drop the model's queued audio at once (barge-in); the chunk playing stops now."""
        now = time.monotonic()
        dropped = [c for c in self._queue if c.kind == "model"]
        self._queue = deque(c for c in self._queue if c.kind != "model")
        flushed = sum(c.samples.size for c in dropped) / self.rate
        if self._playing is not None and self._playing.kind == "model" and self._end > now:
            flushed += self._end - now
            self.sink.cut(now)
            self._retire(self._playing, now)
        for c in dropped:
            self._retire(c, now, played=False)
        if self._seg is not None:
            self._seg.cut = True
        self._space.set()
        self._wake.set()
        self.stats["cuts"] += 1
        self.stats["flushed_s"] += flushed
        self._note("cut")

    def play_clip(self, pcm: np.ndarray, name: str = "clip") -> None:
        """Queue a clip after whatever the model still has to say (so the two never overlap)."""
        self.start()
        step = int(CHUNK_S * self.rate)
        for i in range(0, pcm.size, step):
            self._push(_Chunk(pcm[i : i + step], "clip", None, _rate=self.rate))
        self.stats["clips"] += 1
        self._note(f"clip_queued:{name}")

    def stop_clip(self) -> None:
        now = time.monotonic()
        had = any(c.kind == "clip" for c in self._queue)
        self._queue = deque(c for c in self._queue if c.kind != "clip")
        if self._playing is not None and self._playing.kind == "clip" and self._end > now:
            self.sink.cut(now)
            self.stats["clip_s"] -= self._end - now
            self._playing, self._end = None, now
            if self.spans:
                self.spans[-1][2] = now
            had = True
        if had:
            self._note("clip_stopped")
        self._wake.set()

    def _retire(self, chunk: _Chunk, now: float, played: bool = True) -> None:
        if chunk is self._playing:
            self._playing = None
            if chunk.kind == "model":
                self.stats["model_s"] -= max(0.0, self._end - now)
                if chunk.seg is not None:
                    chunk.seg.played_s -= max(0.0, self._end - now)
            self._end = min(self._end, now)
            if self.spans and self.spans[-1][2] > self._end:
                self.spans[-1][2] = self._end
        if chunk.seg is not None:
            chunk.seg.queued -= 1
            self._maybe_finish(chunk.seg)

    def _maybe_finish(self, seg: _Segment) -> None:
        if seg.flushed and seg.queued <= 0 and not seg.done:
            seg.done = True
            self.on_playback_finished(playback_position=max(0.0, seg.played_s), interrupted=seg.cut)

    async def _sleep(self, timeout: float | None) -> None:
        """Until `timeout` passes or the queue changes."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _pace(self) -> None:
        """The play clock: each chunk starts when the previous one ends (or when it may start, if later)."""
        while True:
            now = time.monotonic()
            if self._playing is not None and now >= self._end - 1e-4:
                self._retire(self._playing, now)
                self._space.set()
            if not self._queue:
                await self._sleep(self._end - now if self._playing is not None else None)
                continue
            chunk = self._queue[0]
            # back to back with the chunk before, unless the sink has run dry meanwhile (a real gap)
            start = self._end if now - self._end < LATE_HANDOVER_S else now
            if chunk.kind == "model" and chunk.seg is not None and not chunk.seg.started:
                start = max(start, chunk.arrived + START_DELAY_S)
            # hand a chunk over a little early, so a live sink never runs dry between chunks
            if start - now > 0.005:
                await self._sleep(start - now - 0.005)
                continue
            self._queue.popleft()
            if self._playing is not None:
                self._retire(self._playing, start)
            self._playing, self._end = chunk, start + chunk.duration
            self.spans.append([chunk.kind, start, self._end])
            if chunk.kind == "model":
                self.stats["model_s"] += chunk.duration
                seg = chunk.seg
                if seg is not None:
                    seg.played_s += chunk.duration
                    if seg.started and start > seg.last_end + 1e-4:  # the frame came too late: a gap
                        self.stats["gaps"] += 1
                        self.stats["gap_s"] += start - seg.last_end
                    seg.last_end = self._end
                    if not seg.started:
                        seg.started = True
                        self.on_playback_started(created_at=time.time())
                        self._note("speech_start")
            else:
                self.stats["clip_s"] += chunk.duration
            self._space.set()
            await self.sink.write(chunk.samples, start)

    async def play_out(self, timeout: float = BUFFER_S + 0.5) -> None:
        """Until the audio already handed over has played (the framework's last frames of a turn included), at
        most `timeout`: a call that ends on the agent's side keeps its last words."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while (
            (self._seg is not None or self.queued_s > 1e-3) and loop.time() < until and self._task is not None
        ):
            await asyncio.sleep(0.01)
        if 0 < (left := self.queued_s) <= max(0.0, until - loop.time()):
            await asyncio.sleep(left)  # the last chunk's last millisecond plays too, not cut short

    async def aclose(self) -> None:
        self._paused = False
        if self._ack_timer is not None:
            self._ack_timer.cancel()
        if self._task is not None:
            await aio.cancel_and_wait(self._task)
            self._task = None
        await self.sink.aclose()
