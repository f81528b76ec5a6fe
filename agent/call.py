"""One call: an `AgentSession` running the hotel agent on the shared engine, its playout and its caller audio.

`start_call` is used by the worker's entrypoint (room audio in, a published track out; under
`lk agent console` the console's microphone in, its speaker out) and by the simulation and tests (a WAV or
scripted input, a WAV file out); all get the same model, playout and clips.
Knows livekit-agents sessions and the pieces of `agent/`; nothing of tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession, io, llm, room_io

from agent.audio_in import audio_pump
from agent.audio_in.caller_input import CallerAudio, install_room_input
from agent.audio_out.acks import AckClips
from agent.audio_out.playout import PlayoutOutput
from agent.audio_out.sinks import CallSink
from agent.duplex import VOICED_ENERGY, ChorusModel, ChorusSession
from agent.history import bound_call_memory
from agent.transcript import RoomTranscript
from engine.api import MIN_MARGIN_S
from engine.client.remote import RemoteEngine
from redaction import pseudonym

if TYPE_CHECKING:
    from engine.api import EngineClient, SessionPort
    from engine.config.stage_config import ClockConfig

log = logging.getLogger("chorus.agent.call")


class PcmInput(io.AudioInput):
    """Caller audio from memory, played in real time: `push` int16 mono at `sample_rate` (default: the
    engine's input rate), `end` to hang up. Frames last one engine frame (`clock.frame_ms`). Between pushes it
    yields silence, as a room's microphone track does."""

    def __init__(self, clock: ClockConfig, sample_rate: int | None = None, *, silence: bool = True) -> None:
        super().__init__(label="chorus-pcm")
        self.sample_rate = clock.input_rate if sample_rate is None else sample_rate
        self.step = self.sample_rate * clock.frame_ms // 1000
        self._pending = np.zeros(0, np.int16)
        self._silence = silence
        self._ended = False
        self._t0: float | None = None
        self._n = 0

    def push(self, pcm: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, np.asarray(pcm, dtype=np.int16)])

    def end(self) -> None:
        self._ended = True

    async def __anext__(self) -> rtc.AudioFrame:
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = loop.time()
        while True:
            if self._ended and not self._pending.size:
                raise StopAsyncIteration
            due = self._t0 + self._n * self.step / self.sample_rate
            if due < loop.time() - 2 * self.step / self.sample_rate:  # a reader that fell behind: no burst
                self._t0 += loop.time() - due
                due = loop.time()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            self._n += 1
            if self._pending.size or self._silence:
                pcm, self._pending = self._pending[: self.step], self._pending[self.step :]
                if pcm.size < self.step:
                    pcm = np.concatenate([pcm, np.zeros(self.step - pcm.size, np.int16)])
                return rtc.AudioFrame(pcm.tobytes(), self.sample_rate, 1, self.step)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """int16 mono samples and the rate of a 16-bit WAV (channels are averaged)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM")
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        ch, rate = w.getnchannels(), w.getframerate()
    if ch > 1:
        pcm = pcm.reshape(-1, ch).astype(np.int32).mean(axis=1).astype(np.int16)
    return pcm, rate


@dataclass
class Call:
    session: AgentSession
    model: ChorusModel
    output: PlayoutOutput
    agent: Agent
    closed: bool = False
    transcript: RoomTranscript | None = None  # the agent's words on the room's text stream (in a room)

    @property
    def duplex(self) -> ChorusSession | None:
        return self.model.sessions[-1] if self.model.sessions else None

    @property
    def handle(self) -> SessionPort | None:
        d = self.duplex
        return d.handle if d is not None else None

    async def wait_open(self, timeout: float = 10.0) -> SessionPort:
        """The engine session handle, once the slot is open; the engine's refusal (EngineFull,
        EngineOverloaded, ...) is raised as it came."""
        async with asyncio.timeout(timeout):
            while self.duplex is None:
                await asyncio.sleep(0.01)
            await self.duplex.opened.wait()
        if self.duplex.open_error is not None:
            raise self.duplex.open_error
        return self.handle

    async def aclose(self, *, play_out: bool = False) -> None:
        """End the call. The engine slot is freed first (a caller who left holds nothing, even while a tool
        runs); with `play_out` (the call ends on the agent's side), what is queued for the caller still plays
        (at most the playout buffer), instead of being cut off."""
        if self.closed:
            return
        self.closed = True
        await self.model.aclose()
        if play_out:
            await self.output.play_out()
        with contextlib.suppress(RuntimeError):
            await self.session.aclose()
        if self.transcript is not None:
            await self.transcript.aclose()
        await self.output.aclose()


# The model marks its own turns (TurnGate: a frame is speech between the turn's start and end tokens, and
# a turn ends with an explicit non-speech frame), so the adapter's wait for a missing frame is only a last
# resort for an engine that stopped sending. At the framework's default (0.8 s) a tick that came late on a
# loaded machine split one turn into two generations, the second queued behind the first's playout and its
# words cut in two.
TURN_SILENCE_S = 10.0


def _session(model: ChorusModel) -> AgentSession:
    # no STT/VAD/TTS: the model hears, decides and speaks by itself
    return AgentSession(
        llm=llm.DuplexRealtimeAdapter(model, audio_timeout=TURN_SILENCE_S),
        vad=None,
        turn_handling={
            "turn_detection": None,
            "interruption": {"resume_false_interruption": False, "discard_audio_if_uninterruptible": False},
        },
        # the model must hear the caller while it speaks (barge-in is its own): no AEC warm-up muting
        aec_warmup_duration=None,
        user_away_timeout=None,
        max_tool_steps=8,
    )


async def start_call(
    engine: EngineClient,
    agent: Agent,
    *,
    sink: CallSink,
    audio_input: io.AudioInput | None = None,
    room: rtc.Room | None = None,
    participant: str | None = None,
    acks: bool = True,
    label: str | None = None,
    caller: str | None = None,
    admission: str | None = None,
    context: str = "",
) -> Call:
    """Start the session; returns once the framework runs it (the engine slot opens right after). `label` and
    `caller` name the call on the monitoring page (default: the room's label, `room_label`, and "phone" for a
    SIP participant, else "web").
    `admission` is the job whose engine slot the worker reserved on accepting it (`RemoteEngine.admit`);
    `context`, the call's own part of its prompt (`ChorusModel`)."""
    clock = engine.model_cfg.clock
    output = PlayoutOutput(sink, clock=clock, acks=AckClips(sink.sample_rate) if acks else None)
    if getattr(engine.config, "fixed_buffers", False):  # the benchmarks' baseline: a frame, always
        output.buffer.fixed()
    room_label, room_caller = describe_caller(room, participant)
    if getattr(engine.config, "echo", False):  # the latency benchmark reads each frame's times in the log
        output.buffer.heard.keep_times(room_label if label is None else label)
    model = ChorusModel(
        engine,
        observer=output,
        label=room_label if label is None else label,
        caller=room_caller if caller is None else caller,
        admission=admission,
        context=context,
    )
    session = _session(model)
    call = Call(session, model, output, agent)
    try:
        if room is not None:
            await _start_in_room(call, sink, room, participant, clock)
        else:
            if audio_input is not None:
                session.input.audio = audio_input
            session.output.audio = output
            await session.start(agent=agent, record=False)
        bound_call_memory(session)
        output.start()
    except BaseException:
        await call.aclose()
        raise
    return call


async def _start_in_room(
    call: Call,
    sink: CallSink,
    room: rtc.Room,
    participant: str | None,
    clock: ClockConfig,
) -> None:
    """The session on the room's caller (their audio at the engine's input rate and frame), the agent's voice
    on its own track, or under `lk agent console` on the console's speaker."""
    session, output = call.session, call.output
    opts = room_io.RoomOptions(
        # no automatic gain control: the model's front end normalises what it hears, and the framework's AGC
        # ran WebRTC's audio processing on every caller frame on the room's loop
        audio_input=room_io.AudioInputOptions(
            sample_rate=clock.input_rate,
            num_channels=1,
            frame_size_ms=clock.frame_ms,
            auto_gain_control=False,
        ),
        audio_output=False,
        # the model's words go out through RoomTranscript (agent/transcript.py), set below, which never
        # holds up the turn's audio; each text piece leaves with its own 80 ms frame, already in step with
        # the audio
        text_output=False,
        participant_identity=participant or NOT_SET,
        participant_kinds=[
            rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD,
            rtc.ParticipantKind.PARTICIPANT_KIND_SIP,
        ],
    )
    await sink.join(room)  # a phone call's track may be up already, while it rang
    if not sink.on_session_output:
        session.output.audio = output
    native = None if sink.on_session_output else native_caller_input(call, clock)  # the console's: its mic
    # no session host: the framework would publish every session event (each state change, each item) to
    # the room as a byte stream, for a remote client to observe the session; Chorus's operators watch the
    # monitoring page, and on a loaded worker those sends queued behind the room's audio
    with native.making_input() if native is not None else contextlib.nullcontext():
        await session.start(agent=call.agent, room=room, room_options=opts, record=False, session_host=False)
    if not sink.on_session_output:
        call.transcript = RoomTranscript(room, lambda: sink.track_sid)
        session.output.transcription = call.transcript
    elif session.output.audio is not None:
        # the console put its speaker on the session (none in its text mode): the playout goes in front;
        # the console's transcript sync, paired with that speaker, passes its text to nothing
        sink.attach(session.output.audio)
        session.output.audio = output
        session.output.transcription = None
        log.info("console: the agent's audio goes through the playout to the console's speaker")


def native_caller_input(call: Call, clock: ClockConfig) -> CallerAudio | None:
    """The call's caller audio straight from the rtc runtime into the engine's ring
    (agent/audio_in/caller_input.py), when this process has the native callback and the engine is a ring away
    (not in this process)."""
    lib = audio_pump.installed()
    if lib is None or not isinstance(call.model.engine, RemoteEngine) or not install_room_input():
        return None
    # the frames end just ahead of the ticks, by the tick's own least margin for late frames
    # (engine/tick/phase.py); the benchmarks' fixed-buffer baseline leaves them where they fall
    lead_s = 0.0 if getattr(call.model.engine.config, "fixed_buffers", False) else MIN_MARGIN_S
    call.model.caller_audio = CallerAudio(
        lib,
        rate=clock.input_rate,
        frame=clock.input_samples,
        loud=VOICED_ENERGY,
        frame_ms=clock.frame_ms,
        lead_s=lead_s,
    )
    return call.model.caller_audio


def room_label(room: str) -> str:
    """The name a room goes by outside LiveKit (the monitoring page, the worker's log): `room-kqzvbxdt`, a
    pseudonym of its name (redaction/). A room's name is its caller's choice, or their number (a SIP
    dispatch rule names a call's room after it: `call-_+14155550123_AbCd`), so none of it is shown; the label
    is the same for the whole call, on every worker, and distinct between rooms. "" for no name."""
    return pseudonym("room", room) if room else ""


def describe_caller(room: rtc.Room | None, participant: str | None) -> tuple[str, str]:
    """(the room's label, `room_label`; "phone" for a SIP participant else "web"); ("", "") without a room."""
    if room is None:
        return "", ""
    name = room_label(str(getattr(room, "name", "") or ""))
    remote = getattr(room, "remote_participants", None) or {}
    who = remote.get(participant) if participant and isinstance(remote, Mapping) else None
    sip = who is not None and getattr(who, "kind", None) == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
    return name, "phone" if sip else "web"


NOT_SET: Any = room_io.RoomOptions.__dataclass_fields__["participant_identity"].default
