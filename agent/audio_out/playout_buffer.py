"""The agent's voice on a wall clock: a paced buffer in front of a sink, as deep as the measured jitter needs.

The model's turns arrive as segments of chunks; each chunk starts when the one before ends, a turn's first one
late by the start delay: as late as the frames of recent turns arrived behind their cadence (`ArrivalJitter`),
so a turn plays without a gap on a machine whose ticks jitter and starts promptly on one whose ticks are
steady; within a turn, audio that keeps waiting longer than the jitter needs is played sooner (its excess
cut from quiet stretches, `shorten`); a barge-in drops what is queued at once; clips queue after the model's
words and never play over them. Knows samples, seconds and the sink's contract (agent/audio_out/sinks.py);
nothing of livekit-agents, sessions or models (agent/audio_out/playout.py adapts it to the framework's audio
output).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from livekit.agents.utils import aio

from agent.audio_out.heard import HeardCounter
from agent.audio_out.playout_timing import ArrivalJitter, Wake, shorten

BUFFER_FRAMES = 2  # the playout buffer: at least this many engine frames of audio queued ahead of the play
START_DELAY_FRAMES = 1  # a call's first turns wait one frame, until the jitter has been measured
LATE_HANDOVER_S = 0.02  # a chunk handed over this late still joins the one before (the sink's own slack)
# within a turn, audio that waited longer than the measured jitter needs, for TRIM_AFTER chunks in a row, is
# played sooner: the excess (at most TRIM_MAX_S at a time, at least TRIM_MIN_S) is cut from the chunk's
# quietest stretch with a short crossfade, as NetEQ's accelerate does (a turn that began before the jitter
# was measured waited a whole frame; it need not for the rest of the turn)
TRIM_AFTER = 2
TRIM_MIN_S = 0.004
TRIM_MAX_S = 0.04
TRIM_FADE_S = 0.0025
HANDOVER_EARLY_S = 0.005  # a chunk goes to the sink this early, so a live sink never runs dry between chunks
HISTORY = 1024  # playout events and spans kept per call (about a thousand chunks)


class Sink(Protocol):
    """What the buffer plays into (agent/audio_out/sinks.py)."""

    sample_rate: int

    async def write(self, samples: np.ndarray, at: float) -> None: ...

    def cut(self, at: float) -> None: ...

    async def aclose(self) -> None: ...


@dataclass
class _Segment:
    """One of the model's turns as the buffer plays it."""

    queued: int = 0  # chunks queued or playing
    played_s: float = 0.0
    started: bool = False
    ended: bool = False  # no more audio will be written to it
    cut: bool = False
    done: bool = False
    last_end: float = 0.0  # when its last chunk so far ends playing


@dataclass
class _Chunk:
    samples: np.ndarray
    kind: str  # "model" or "clip"
    seg: _Segment | None
    duration: float
    arrived: float = field(default_factory=time.monotonic)
    late: float = 0.0  # behind its turn's cadence when it arrived (`ArrivalJitter.observe`)


def _nothing(*_: object) -> None:
    pass


class PlayoutBuffer:
    """Queue and play clock of one call's output (see the module docstring). `on_started()` is called when a
    segment's first chunk starts playing, `on_finished(played_s, interrupted)` once a segment that has ended
    has played (or been cut); all calls on the event loop that runs the buffer."""

    def __init__(
        self,
        sink: Sink,
        frame_s: float,
        *,
        on_started: Callable[[], None] = _nothing,
        on_finished: Callable[[float, bool], None] = _nothing,
    ) -> None:
        self.sink = sink
        self.rate = sink.sample_rate
        self.frame_s = frame_s
        self.jitter = ArrivalJitter(frame_s, START_DELAY_FRAMES * frame_s)
        self.clip_chunk = max(1, round(frame_s * self.rate))  # clips are played in chunks of one frame
        self._on_started, self._on_finished = on_started, on_finished
        self._queue: deque[_Chunk] = deque()
        self._playing: _Chunk | None = None
        self._end = 0.0  # when the chunk now playing ends
        self._seg: _Segment | None = None  # the segment being written
        self._wake = Wake()  # the queue changed
        self._space = asyncio.Event()  # room in the buffer, or the segment cut
        self._drained = asyncio.Event()  # no segment open, nothing queued, nothing playing
        self._drained.set()
        self._task: asyncio.Task | None = None
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
            "gaps": 0,  # silences heard inside the model's turns (agent/audio_out/heard.py)
            "gap_s": 0.0,
            "late_absorbed": 0,  # the model's frames that came late and played without a gap
            "dropped_s": 0.0,
            "trimmed_s": 0.0,
            "model_chunks": 0,  # the model's chunks played, and how long they waited from arrival to play
            "waited_s": 0.0,
        }
        self.heard = HeardCounter()
        self._waits: deque[float] = deque(maxlen=TRIM_AFTER)  # how long the turn's last chunks sat queued
        # where the engine learns what the playout costs (its snapshot and /metrics): called with the audio
        # queued ahead of the ear, the gaps and their seconds, the start delay, when the last turn's first
        # chunk went to the sink, and the late frames absorbed, as each chunk starts playing and on a cut
        # (`SessionHandle.report_playout`)
        self.report: Callable[..., None] | None = None
        self._turn_played_at = 0.0

    def fixed(self) -> None:
        """The baseline the benchmarks compare with: every turn starts a frame late and nothing is trimmed,
        whatever the jitter (the playout before it followed the measured jitter)."""
        self.jitter.warmup = 10**9

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._pace(), name="chorus.playout")

    def note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    @property
    def start_delay_s(self) -> float:
        """How long a turn's first chunk waits after it arrived (`ArrivalJitter.delay`)."""
        return self.jitter.delay(time.monotonic())

    @property
    def buffer_s(self) -> float:
        """The most audio queued ahead of the play head: what a start delay holds back, and a frame more."""
        return max(BUFFER_FRAMES * self.frame_s, self.start_delay_s + self.frame_s)

    @property
    def queued_s(self) -> float:
        ahead = sum(c.samples.size for c in self._queue) / self.rate
        return ahead + max(0.0, self._end - time.monotonic()) if self._playing else ahead

    @property
    def clip_playing(self) -> bool:
        return (
            self._playing is not None and self._playing.kind == "clip" and self._end > time.monotonic()
        ) or any(c.kind == "clip" for c in self._queue)

    # -- the model's segments --------------------------------------------------------------------------

    def begin_segment(self) -> None:
        """The model speaks (again): what is written from now on is one segment; a clip still queued stops."""
        if self._seg is None:
            self._seg = _Segment()
            self.jitter.begin_turn()
            self.stats["segments"] += 1
            self._drained.clear()
            self.stop_clip()

    async def write(self, pcm: np.ndarray) -> None:
        """Queue int16 mono samples of the open segment, waiting while the buffer is full; the rest of a
        segment the caller interrupted is dropped (and counted)."""
        seg = self._seg
        if seg is None:
            raise RuntimeError("playout: write outside a segment (begin_segment first)")
        arrived = time.monotonic()
        late = self.jitter.observe(arrived)
        while not seg.cut and self.queued_s + pcm.size / self.rate > self.buffer_s + 1e-6:
            self._space.clear()
            await self._space.wait()
        if seg.cut:
            self.stats["dropped_s"] += pcm.size / self.rate
            return
        self._push(_Chunk(pcm, "model", seg, pcm.size / self.rate, arrived, late))

    def end_segment(self) -> None:
        """No more audio of this segment: it finishes once what it queued has played."""
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.ended = True
            self._maybe_finish(seg)
        self._check_drained()

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
            self._retire(c, now)
        if self._seg is not None:
            self._seg.cut = True
        self._space.set()
        self._wake.set()
        self.stats["cuts"] += 1
        self.stats["flushed_s"] += flushed
        self.note("cut")
        self._report()
        self._check_drained()

    # -- clips -----------------------------------------------------------------------------------------

    def play_clip(self, pcm: np.ndarray, name: str = "clip") -> None:
        """Queue a clip after whatever the model still has to say (so the two never overlap)."""
        self.start()
        for i in range(0, pcm.size, self.clip_chunk):
            part = pcm[i : i + self.clip_chunk]
            self._push(_Chunk(part, "clip", None, part.size / self.rate))
        self.stats["clips"] += 1
        self.note(f"clip_queued:{name}")

    def stop_clip(self) -> None:
        now = time.monotonic()
        had = any(c.kind == "clip" for c in self._queue)
        self._queue = deque(c for c in self._queue if c.kind != "clip")
        if self._playing is not None and self._playing.kind == "clip" and self._end > now:
            self.sink.cut(now)
            self.stats["clip_s"] -= self._end - now
            self._playing, self._end = None, now
            self._cut_span(now)
            had = True
        if had:
            self.note("clip_stopped")
        self._wake.set()
        self._check_drained()

    # -- the play clock --------------------------------------------------------------------------------

    def _push(self, chunk: _Chunk) -> None:
        if chunk.seg is not None:
            chunk.seg.queued += 1
        self._queue.append(chunk)
        self._drained.clear()
        self._wake.set()

    def _retire(self, chunk: _Chunk, now: float) -> None:
        """`chunk` is over at `now` (played to its end, or cut there); its segment may be finished."""
        if chunk is self._playing:
            self._playing = None
            if chunk.kind == "model":
                self.stats["model_s"] -= max(0.0, self._end - now)
                if chunk.seg is not None:
                    chunk.seg.played_s -= max(0.0, self._end - now)
            self._end = min(self._end, now)
            self._cut_span(self._end)
        if chunk.seg is not None:
            chunk.seg.queued -= 1
            self._maybe_finish(chunk.seg)

    def _cut_span(self, at: float) -> None:
        """The chunk playing ends at `at`: one handed to the sink early (HANDOVER_EARLY_S) and cut before
        its start played nothing (a span of no length at its start)."""
        if self.spans and self.spans[-1][2] > at:
            self.spans[-1][2] = max(at, self.spans[-1][1])

    def _maybe_finish(self, seg: _Segment) -> None:
        if seg.ended and seg.queued <= 0 and not seg.done:
            seg.done = True
            self._on_finished(max(0.0, seg.played_s), seg.cut)

    def _check_drained(self) -> None:
        if self._seg is None and not self._queue and self._playing is None:
            self._drained.set()

    async def _sleep(self, timeout: float | None) -> None:
        """Until `timeout` passes or the queue changes."""
        await self._wake.sleep(timeout)

    async def _pace(self) -> None:
        """Each chunk starts when the previous one ends (or when it may start, if later)."""
        while True:
            now = time.monotonic()
            if self._playing is not None and now >= self._end - 1e-4:
                self._retire(self._playing, now)
                self._space.set()
                self._check_drained()
            if not self._queue:
                await self._sleep(self._end - now if self._playing is not None else None)
                continue
            chunk = self._queue[0]
            # back to back with the chunk before, unless the sink has run dry meanwhile (a real gap)
            start = self._end if now - self._end < LATE_HANDOVER_S else now
            dry = chunk.kind == "model" and chunk.seg is not None and chunk.seg.started and start == now
            if chunk.kind == "model" and chunk.seg is not None and (not chunk.seg.started or dry):
                # a turn's first chunk, or the first after its frames came too late for it (a gap): it waits
                # the start delay, so the rest of the turn has the cushion the measured jitter needs
                start = max(start, chunk.arrived + self.start_delay_s)
                self._waits.clear()
            if start - now > HANDOVER_EARLY_S:
                await self._sleep(start - now - HANDOVER_EARLY_S)
                continue
            self._queue.popleft()
            if chunk.kind == "model":
                self._trim(chunk, start - chunk.arrived)
            self._play(chunk, start)
            self._space.set()
            await self.sink.write(chunk.samples, start)

    def _trim(self, chunk: _Chunk, waited: float) -> None:
        """`chunk` sat `waited` seconds before playing: once TRIM_AFTER chunks in a row waited more than the
        start delay the measured jitter needs (and the jitter has been measured), cut the excess from this
        one, so the rest of the turn plays that much sooner."""
        self._waits.append(waited)
        if self.jitter.measured < self.jitter.warmup or len(self._waits) < TRIM_AFTER:
            return
        excess = min(min(self._waits) - self.start_delay_s, TRIM_MAX_S, chunk.duration / 2)
        if excess < TRIM_MIN_S:
            return
        chunk.samples = shorten(chunk.samples, round(excess * self.rate), round(TRIM_FADE_S * self.rate))
        cut = chunk.duration - chunk.samples.size / self.rate
        chunk.duration -= cut
        self.stats["trimmed_s"] += cut
        self._waits.clear()

    def _play(self, chunk: _Chunk, start: float) -> None:
        """`chunk` is the one playing from `start`: the figures and the segment's start and gaps."""
        if self._playing is not None:
            self._retire(self._playing, start)
        self._playing, self._end = chunk, start + chunk.duration
        self.spans.append([chunk.kind, start, self._end])
        if chunk.kind == "model" and chunk.seg is not None and not chunk.seg.started:
            self._turn_played_at = start  # a turn's first chunk: when it goes to the sink
        if chunk.kind != "model":
            self.stats["clip_s"] += chunk.duration
            self._report()
            return
        self.stats["model_s"] += chunk.duration
        self.stats["model_chunks"] += 1
        self.stats["waited_s"] += start - chunk.arrived
        seg = chunk.seg
        if seg is None:
            self._report()
            return
        seg.played_s += chunk.duration
        heard = self.heard
        if heard.frame(chunk.late, seg.last_end if seg.started else None, start, chunk.arrived):  # a gap
            self.stats["gaps"], self.stats["gap_s"] = heard.gaps, heard.gap_s
        self.stats["late_absorbed"] = heard.absorbed
        self._report()  # with this chunk's gap or absorption counted
        seg.last_end = self._end
        if not seg.started:
            seg.started = True
            self._on_started()
            self.note("speech_start")

    def _report(self) -> None:
        if self.report is not None:
            st = self.stats
            self.report(
                self.queued_s,
                int(st["gaps"]),
                st["gap_s"],
                self.start_delay_s,
                self._turn_played_at,
                int(st["late_absorbed"]),
            )

    async def play_out(self, timeout: float | None = None) -> None:
        """Until the open segment has ended and everything queued has played to its last sample, at most
        `timeout` seconds (default: the buffer and half a second): a call that ends on the agent's side keeps
        its last words."""
        if self._task is None:
            return  # nothing was ever played
        timeout = self.buffer_s + 0.5 if timeout is None else timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), max(0.0, timeout))

    async def aclose(self) -> None:
        self.heard.close()
        if self._task is not None:
            await aio.cancel_and_wait(self._task)
            self._task = None
        await self.sink.aclose()
