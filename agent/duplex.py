"""The shared engine as a livekit-agents duplex model: one `ChorusModel` per call, one engine
slot per session.

Caller audio of any rate and channel count goes in as mono at the engine's input rate; the engine's output
frames come out on `audio_stream` (its silence included), the text channel as transcript deltas, the model's
tool calls as `function_call` events, and tool outputs go back as engine tool results. Every caller frame goes
to the engine, which holds what arrives while the session is paused and replays it faster than real time;
frames that arrive before the engine slot is open are held here (bounded, counted) and handed over when it
opens. Rates and frame sizes are the engine's clock. Knows livekit-agents and the engine contract
(`engine.api`); nothing of tensors, rooms or hotels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Any

import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from livekit.agents.utils import aio

from agent import call_trace, tracing
from agent.audio_in.caller_audio import InputConverter
from agent.tool_schemas import tool_schemas
from agent.turns import SPEECH, CallObserver, TurnGate, cut_short
from engine.api import (
    AudioFrame,
    EngineError,
    EngineFull,
    FunctionCall,
    Output,
    SessionFailed,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
    TurnEnded,
    TurnStarted,
)

if TYPE_CHECKING:
    from agent.audio_in.caller_input import CallerAudio
    from engine.api import EngineClient, SessionPort

log = logging.getLogger("chorus.agent.duplex")

VOICE_RMS = 0.02  # caller frames louder than this (about -34 dBFS) count as speech
VOICED_ENERGY = (VOICE_RMS * 32768.0) ** 2  # ...as the mean square of int16 samples
HELD_BEFORE_OPEN_S = 30.0  # caller audio kept while the engine slot opens (oldest dropped and counted beyond)


class ChorusModel(llm.DuplexModel):
    """The process-wide engine seen as one call's duplex model.
    The engine is shared and outlives the model."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        observer: CallObserver | None = None,
        label: str = "",
        caller: str = "",
        admission: str | None = None,
        context: str = "",
    ) -> None:
        """`label` (the room's name) and `caller` ("web", "phone") name the call on the monitoring page;
        `admission` is the job whose slot the engine reserved for this call (its first session takes it);
        `context` is the call's own part of the prompt, after the agent's instructions and tools (the earlier
        turns of a call carried on after a break, `agent.fleet.carry.resume_context`)."""
        super().__init__(
            capabilities=llm.DuplexCapabilities(user_transcription=False, auto_tool_reply_generation=True)
        )
        self.engine = engine
        self.observer = observer or CallObserver()
        self.session_label, self.caller_kind = label, caller  # (`label` is the framework's own property)
        self.sessions: list[ChorusSession] = []
        self.admission = admission
        self.context = context
        # the caller's audio when it goes to the engine's ring natively (agent/audio_in/audio_pump.py), not
        # through `ChorusSession.push_audio`: its ring is handed over when the slot opens
        self.caller_audio: CallerAudio | None = None
        self.trace = call_trace.current()  # the call's spans (agent/call_trace.py), made by its job

    @property
    def model(self) -> str:
        return f"chorus-{self.engine.config.preset}"

    @property
    def provider(self) -> str:
        return "chorus"

    def audio_gate(self) -> TurnGate:
        return TurnGate()

    def session(self) -> ChorusSession:
        s = ChorusSession(self)
        self.sessions.append(s)
        return s

    async def aclose(self) -> None:
        for s in self.sessions:
            await s.aclose()


class ChorusSession(llm.DuplexSession):
    """One conversation on one engine slot. The slot is opened once the prompt and tools are configured and
    freed by `aclose`; everything here runs on the session's own event loop."""

    def __init__(self, model: ChorusModel) -> None:
        super().__init__(model)
        self._model = model
        self._loop = asyncio.get_running_loop()
        self._instructions = ""
        self._tools: list[llm.Tool] = []
        self._tool_ctx = llm.ToolContext.empty()
        self._audio_ch = aio.Chan[llm.DuplexAudioFrame]()
        clock = model.engine.model_cfg.clock
        self._in_frame = clock.input_samples
        self._out_rate = clock.output_rate
        self._input = InputConverter(clock.input_rate, clock.input_samples)
        # caller frames that arrive before the slot is open, handed to the engine when it opens
        self._held: deque[np.ndarray] = deque(maxlen=max(1, int(HELD_BEFORE_OPEN_S * 1000 / clock.frame_ms)))
        self.first_frame = asyncio.Event()  # the engine has sent its first frame: the session is live
        self._opening_at = time.monotonic()
        self._last_speech_tick = -10
        self.handle: SessionPort | None = None  # the engine session once opened
        self.opened = asyncio.Event()  # the attempt to open is over: `handle`, or `open_error`
        self.open_error: EngineError | None = None
        self.speaking = False
        self.paused = False
        self._turn_text = ""
        self._answered: set[str] = set()  # call ids whose result went to the engine
        # the call's conversation as it goes (agent/fleet/carry.py ConversationLog: said, called, answered),
        # or None
        self.record: Any = None
        self._audio_ms = 0  # the adapter's audio clock: output audio handed over so far
        self._voiced_at = -1e9  # monotonic time of the last loud caller frame
        self.stats = {
            "frames_out": 0,
            "speech_frames": 0,
            "turns": 0,
            "barge_ins": 0,
            "function_calls": 0,
            "tool_results": 0,
            "rejected_calls": 0,
            "pauses": 0,
            "resumes": 0,
            "frames_pushed": 0,
            "frames_held": 0,
            "held_dropped": 0,
            "input_errors": 0,
        }
        self._task = asyncio.create_task(self._run(), name="chorus.session")

    # -- the framework's side --------------------------------------------------------------------------

    @property
    def audio_stream(self) -> AsyncIterable[llm.DuplexAudioFrame]:
        return self._audio_ch

    @property
    def tools(self) -> llm.ToolContext:
        return self._tool_ctx

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        """Called by the framework's audio forwarding for every caller frame: nothing may escape from here (it
        would end the forwarding for the rest of the call), so a failure is counted and logged instead."""
        if self._closing:
            return
        try:
            for chunk in self._input.push(frame):
                x = chunk.astype(np.float32)
                if float(x @ x) > VOICED_ENERGY * x.size:
                    self._voiced_at = time.monotonic()
                self.stats["frames_pushed"] += 1
                # the engine holds what it cannot take yet (prompt, tool pause) and replays it faster than
                # real time once the session is live again; before the slot is open it is held here
                if self.handle is None:
                    if len(self._held) == self._held.maxlen:
                        self.stats["held_dropped"] += 1
                    self._held.append(chunk)
                    self.stats["frames_held"] += 1
                elif not self.handle.closed:
                    self.handle.push_audio(chunk)
        except Exception:  # whatever one frame's forwarding raised: counted and logged once, the call goes on
            self.stats["input_errors"] += 1
            if self.stats["input_errors"] == 1:
                log.exception("session %s: caller audio could not be forwarded", self._id())

    def _id(self) -> str:
        return self.handle.id if self.handle is not None else "(opening)"

    async def _update_instructions(self, instructions: str) -> None:
        if self.handle is not None and instructions != self._instructions:
            log.warning("session %s: instructions are fixed once the call started; ignored", self.handle.id)
            return
        self._instructions = instructions

    async def _update_tools(self, tools: list[llm.Tool]) -> None:
        if self.handle is not None:
            log.warning("session %s: tools are fixed once the call started; ignored", self.handle.id)
            return
        self._tools = list(tools)
        self._tool_ctx = llm.ToolContext(tools)

    async def _append_items(self, items: list[llm.ChatItem]) -> None:
        for item in items:
            if not isinstance(item, llm.FunctionCallOutput) or self.handle is None:
                continue
            if self._closing or self.handle.closed:
                log.info("session %s: late result of %s discarded", self.handle.id, item.call_id)
                continue
            if item.call_id in self._answered:  # the framework's context diff may hand an item over again
                continue
            self._answered.add(item.call_id)
            self.handle.submit_tool_result(item.call_id, item.output, item.is_error)
            self._model.trace.result(item.call_id, bool(item.is_error))
            self.stats["tool_results"] += 1
            if self.record is not None:
                self.record.answered(item.call_id, str(item.output), bool(item.is_error))

    @property
    def live(self) -> bool:
        return self.first_frame.is_set()

    def _update_options(self, *, tool_choice: NotGivenOr[llm.ToolChoice | None] = NOT_GIVEN) -> None:
        pass  # the model decides by itself whether to call a tool

    async def aclose(self) -> None:
        await super().aclose()
        await aio.cancel_and_wait(self._task)
        self._close_slot()

    def _close_slot(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if not self._audio_ch.closed:
            self._audio_ch.close()

    # -- the engine's side -----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._configured.wait()
            if self._closing:
                return
            try:
                admission, self._model.admission = self._model.admission, None
                self._opening_at = time.monotonic()
                self._model.trace.opening()
                handle = self._model.engine.open_session(
                    self._instructions,
                    tool_schemas(self._tools),
                    loop=self._loop,
                    label=self._model.session_label,
                    caller=self._model.caller_kind,
                    admission=admission,
                    context=self._model.context,
                    trace=tracing.traceparent(self._model.trace.span),
                )
            except EngineError as e:
                # a refusal is an answer, not a fault: no traceback for the framework to log
                e = e.with_traceback(None)
                log.log(
                    logging.INFO if isinstance(e, EngineFull) else logging.WARNING, "no engine session: %s", e
                )
                self.open_error = e
                self._model.trace.opened(e)
                self.opened.set()
                self._error(e)
                return
            while self._held:  # what the caller said while the slot was opening, in order
                handle.push_audio(self._held.popleft())
            if self._model.caller_audio is not None:  # the native caller audio's held frames, then the rest
                self._model.caller_audio.attach(handle)
            self.handle = handle
            report = getattr(handle, "report_playout", None)
            if report is not None:
                self._model.observer.report_playout(report)
            log.info("session %s started (%d tools)", handle.id, len(self._tools))
            self._model.trace.opened()
            self.opened.set()
            outputs: asyncio.Queue = self.handle.outputs
            while True:
                item = await outputs.get()
                self._on_output(item)
                if isinstance(item, SessionFailed):
                    return
        finally:
            self._close_slot()

    def _on_output(self, item: Output) -> None:
        obs = self._model.observer
        if isinstance(item, AudioFrame):
            if not self.live:  # how long its prompt's prefill (and a full engine's queue) kept the caller
                self._model.trace.first_frame()
                log.info(
                    "session %s: first frame %.0f ms after it was asked for",
                    self.handle.id,
                    1000 * (time.monotonic() - self._opening_at),
                )
                self.first_frame.set()
            self._send_audio(item)
        else:
            self._model.trace.event(item, self._heard_at())
        if isinstance(item, TurnStarted):
            self.speaking = True
            self._turn_text = ""
            self.stats["turns"] += 1
            obs.on_turn_started()
        elif isinstance(item, TurnEnded):
            self._end_turn()
        elif isinstance(item, ToolCallStarted):
            # a call that cut the model's turn short (the engine ends the turn on the same tick): that turn's
            # last frames are still on their way through the framework
            was_speaking = self.speaking or item.tick - self._last_speech_tick <= 1
            self._end_turn()
            self.paused = True
            self.stats["pauses"] += 1
            obs.on_tool_pause(was_speaking)
        elif isinstance(item, FunctionCall):
            self.stats["function_calls"] += 1
            if self.record is not None:
                self.record.called(item.call_id, item.name, item.arguments)
            log.info("session %s: tool %s called (%s)", self.handle.id, item.name, item.call_id)
            self.emit(
                "function_call",
                llm.FunctionCall(call_id=item.call_id, name=item.name, arguments=item.arguments),
            )
        elif isinstance(item, ToolCallRejected):
            self.stats["rejected_calls"] += 1
            log.info("session %s: tool call rejected by the engine", self.handle.id)
        elif isinstance(item, ToolResultConsumed):
            self.paused = False
            self.stats["resumes"] += 1
            obs.on_tool_resume()
        elif isinstance(item, SessionFailed):
            log.error("session %s failed in the engine", self.handle.id)
            self._error(RuntimeError(item.message))

    def _send_audio(self, item: AudioFrame) -> None:
        start = self._audio_ms
        self._audio_ms += round(item.samples.size * 1000 / self._out_rate)
        self.stats["frames_out"] += 1
        if not self.speaking:
            # the adapter's gate would drop it: a frame outside the model's turns goes no further (its time
            # still counts: the next frame sent carries its place on the timeline)
            return
        pcm = (np.clip(item.samples, -1.0, 1.0) * 32767.0).astype(np.int16)
        frame = rtc.AudioFrame(pcm.tobytes(), self._out_rate, 1, pcm.size)
        frame.userdata[SPEECH] = True
        self.stats["speech_frames"] += 1
        self._last_speech_tick = item.tick
        if not self._audio_ch.closed:
            self._audio_ch.send_nowait(llm.DuplexAudioFrame(frame, start_ms=start))
        if self.speaking and item.text:
            self._turn_text += item.text
            self.emit("transcript_delta", llm.DuplexOutputTranscriptDelta(item.text, start, self._audio_ms))

    def _end_turn(self) -> None:
        if not self.speaking:
            return
        self.speaking = False
        if self.record is not None:
            self.record.said(self._turn_text)
        # a caller who spoke just now and a sentence left unfinished: the model stopped for the caller
        barge_in = cut_short(self._heard_at(), self._turn_text)
        if barge_in:
            self.stats["barge_ins"] += 1
        # an empty non-speech frame closes the adapter's burst now rather than on the next frame or timeout
        if not self._audio_ch.closed:
            self._audio_ch.send_nowait(llm.DuplexAudioFrame(rtc.AudioFrame(b"", self._out_rate, 1, 0)))
        self._model.observer.on_turn_ended(barge_in)

    def _heard_at(self) -> float:
        """The monotonic time of the caller's last loud frame (here or in the native caller audio)."""
        voiced_at = self._voiced_at
        if self._model.caller_audio is not None:
            voiced_at = max(voiced_at, self._model.caller_audio.voiced_at)
        return voiced_at

    def _error(self, e: Exception) -> None:
        self.emit(
            "error",
            llm.RealtimeModelError(
                timestamp=time.time(), label=self._model.label, error=e, recoverable=False
            ),
        )
