"""The agent's voice on its way out: the session's `io.AudioOutput` in front of the paced playout buffer.

`PlayoutOutput` takes the framework's frames of the model's turns into the buffer
(agent/audio_out/playout_buffer.py), reports their playback back to the framework, cuts them when the caller
barges in, fills a tool pause with an acknowledgement clip that never overlaps the model's speech, and waits
for a turn to have played before a phone line is handed over. Knows livekit-agents' output contract and the
duplex session's observer; nothing of models, tensors or how the buffer keeps time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import numpy as np
from livekit import rtc
from livekit.agents import io

from agent import call_trace
from agent.audio_out.acks import AckClips
from agent.audio_out.playout_buffer import PlayoutBuffer, Sink
from agent.turns import CallObserver
from engine.config.stage_config import ClockConfig

ACK_FALLBACK_S = 0.5  # a clip waits at most this long for the interrupted turn's audio to arrive
HOLD_CLIP = "ack_bear"  # "Bear with me a moment.": while a call's new agent is not live yet (`hold_on`)


class PlayoutOutput(io.AudioOutput, CallObserver):
    """The session's audio output and the duplex session's observer (see the module docstring). `clock` is
    the engine's frame clock (default: the engine's standard one), which sizes the buffer in frames."""

    def __init__(
        self,
        sink: Sink,
        *,
        clock: ClockConfig | None = None,
        acks: AckClips | None = None,
        label: str = "chorus",
    ) -> None:
        super().__init__(
            label=label, capabilities=io.AudioOutputCapabilities(pause=False), sample_rate=sink.sample_rate
        )
        frame_s = (clock or ClockConfig()).frame_ms / 1000
        self.buffer = PlayoutBuffer(
            sink,
            frame_s,
            on_started=lambda: self.on_playback_started(created_at=time.time()),
            on_finished=lambda played_s, cut: self.on_playback_finished(
                playback_position=played_s, interrupted=cut
            ),
        )
        self.acks = acks
        self._paused = False  # the model is paused for a tool
        self._ack_on_flush = False
        self._ack_timer: asyncio.TimerHandle | None = None
        self.turns_started = self.turns_ended = 0  # the model's turns (see `after_next_turn`)
        self._turns = asyncio.Event()  # a turn started or ended
        self.trace = call_trace.current()  # the call's spans: each clip played (agent/call_trace.py)
        self._clip: tuple[int, int, str] | None = None  # the clip playing: when it began, its length (ns)

    # -- readings (the buffer's) -----------------------------------------------------------------------

    @property
    def sink(self) -> Sink:
        return self.buffer.sink

    @property
    def stats(self) -> dict[str, float]:
        """Seconds of model speech and clips played, cut, flushed, dropped; segments, gaps, clips."""
        return self.buffer.stats

    @property
    def events(self) -> deque[tuple[float, str]]:
        """Recent (monotonic time, what) of the playout: speech starts, cuts, clips, pauses and resumes."""
        return self.buffer.events

    @property
    def spans(self) -> deque[list]:
        """Recent [kind, start, end] of each chunk played ("model" or "clip"), their ends where cut."""
        return self.buffer.spans

    @property
    def queued_s(self) -> float:
        return self.buffer.queued_s

    @property
    def clip_playing(self) -> bool:
        return self.buffer.clip_playing

    def start(self) -> None:
        self.buffer.start()

    # -- io.AudioOutput --------------------------------------------------------------------------------

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        self.buffer.start()
        self.buffer.begin_segment()
        if frame.samples_per_channel == 0:
            return
        if frame.sample_rate != self.buffer.rate:
            raise ValueError(f"playout: expected {self.buffer.rate} Hz frames, got {frame.sample_rate} Hz")
        pcm = np.frombuffer(frame.data, dtype=np.int16).copy()
        if frame.num_channels > 1:
            pcm = pcm.reshape(-1, frame.num_channels)[:, 0].copy()
        await self.buffer.write(pcm)

    def flush(self) -> None:
        super().flush()
        self.buffer.end_segment()
        if self._ack_on_flush:
            self._start_ack()

    def clear_buffer(self) -> None:
        self.buffer.cut()
        self.buffer.end_segment()

    # -- CallObserver ----------------------------------------------------------------------------------

    def on_turn_started(self) -> None:
        self.turns_started += 1
        self._turns.set()
        self.buffer.stop_clip()
        self._clip_over()

    def on_turn_ended(self, barge_in: bool) -> None:
        self.turns_ended += 1
        self._turns.set()
        if barge_in:
            self.buffer.cut()

    def on_tool_pause(self, after_speech: bool) -> None:
        self.buffer.note("pause")
        if self.acks is None:
            return
        self._paused = True
        if after_speech:
            # the turn the call cut short still reaches us through the framework: the clip follows its flush
            self._ack_on_flush = True
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_FALLBACK_S, self._start_ack)
        else:
            self._start_ack()

    def hold_on(self) -> None:
        """The call's new agent is not live yet (a session that carries a call on after a break prefills
        the earlier conversation first): the caller hears "bear with me" rather than more silence; the
        model's first turn stops the clip if it is still playing."""
        if self.acks is not None and not self.buffer.clip_playing:
            name, pcm = self.acks.named(HOLD_CLIP)
            self.buffer.play_clip(pcm, name)
            self._clip_begun(name, pcm)

    def report_playout(self, report: Callable[..., None]) -> None:
        self.buffer.report = report

    def on_tool_resume(self) -> None:
        self.buffer.note("resume")
        self._paused = False
        self._cancel_ack()
        self.buffer.stop_clip()
        self._clip_over()

    def _cancel_ack(self) -> None:
        self._ack_on_flush = False
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None

    def _start_ack(self) -> None:
        self._cancel_ack()
        if self._paused and self.acks is not None:
            name, pcm = self.acks.next()
            self.buffer.play_clip(pcm, name)
            self._clip_begun(name, pcm)

    def _clip_begun(self, name: str, pcm: np.ndarray) -> None:
        self._clip_over()
        self._clip = (time.time_ns(), int(1e9 * pcm.size / self.sample_rate), name)

    def _clip_over(self) -> None:
        """The clip playing, stopped now or over already, as a span of the call."""
        if self._clip is not None:
            start, length, name = self._clip
            self._clip = None
            self.trace.clip(start, min(start + length, time.time_ns()), name)

    # -- the end of a turn, the end of a call ----------------------------------------------------------

    async def _turns_until(self, done: Callable[[], bool], until: float) -> bool:
        """Until `done()` holds (True) or the loop's clock reaches `until` (False), woken by turn events."""
        loop = asyncio.get_running_loop()
        while not done():
            if (left := until - loop.time()) <= 0:
                return False
            self._turns.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._turns.wait(), left)
        return True

    async def after_next_turn(self, timeout: float) -> bool:
        """Until a turn the model starts from now on has ended and its audio has played (True), or `timeout`
        seconds (False): the moment a phone call may be handed over or hung up after the agent said so."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        started = self.turns_started
        if not await self._turns_until(lambda: self.turns_started > started, until):
            return False
        await self._turns_until(lambda: self.turns_ended >= self.turns_started, until)
        await self.play_out(timeout=max(0.0, until - loop.time()))
        return self.turns_ended >= self.turns_started

    async def play_out(self, timeout: float | None = None) -> None:
        """Until the audio already handed over has played (the framework's last frames of a turn included), at
        most `timeout` (default: the buffer and half a second): a call that ends on the agent's side keeps its
        last words."""
        await self.buffer.play_out(timeout)

    async def aclose(self) -> None:
        self._paused = False
        self._cancel_ack()
        self._clip_over()
        await self.buffer.aclose()
