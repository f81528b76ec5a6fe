"""The engine contract as `agent/` and `ui/` see it: errors, per-tick outputs, session events
and the snapshot.

Plain data only: no tensors, no threads. Everything a session receives from the tick thread is one of the
types below, delivered in tick order on the session's own event loop (or to its sink). `EngineSnapshot` is the
one description of the engine's state: the monitoring page, the benchmarks and `/snapshot` read it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from pydantic import BaseModel

if TYPE_CHECKING:
    from engine.config.stage_config import ClockConfig, TokenConfig
    from engine.text.tokens import Tokens

LAST_WORDS = 60  # characters of the agent's last turn a snapshot carries (the page shortens them further)
# the least a caller's frame leads the tick that takes it by (engine/tick/phase.py): a room cuts its frames to
# end this far ahead of the ticks
MIN_MARGIN_S = 0.008


class EngineError(RuntimeError):
    """Base of the engine's own errors."""


class EngineFull(EngineError):
    """Every slot is taken; the caller should be routed to another worker."""


class EngineOverloaded(EngineFull):
    """Slots are free but the tick has no headroom left (its recent live step is near the 80 ms budget, or
    deadlines were missed): the caller should be routed to another worker. A kind of EngineFull."""


class EngineClosed(EngineError):
    """The engine was shut down, or the session was closed."""


class SessionRejected(EngineError):
    """open_session's arguments were refused (too many tools, a prompt that does not fit)."""


@dataclass(frozen=True)
class AudioFrame:
    """80 ms of agent speech: float32 samples in [-1, 1] at the engine's output rate (22.05 kHz)."""

    tick: int
    samples: np.ndarray  # [1764] float32
    # what the text channel's token adds to the transcript, in whole characters ("" when silent, for a control
    # token, and for the first bytes of a character split over several tokens: it comes whole with its last)
    text: str = ""


@dataclass(frozen=True)
class TurnStarted:
    tick: int


@dataclass(frozen=True)
class TurnEnded:
    tick: int


@dataclass(frozen=True)
class ToolCallStarted:
    """The model began a tool call: the session is paused (no agent audio) until the results are consumed."""

    tick: int


@dataclass(frozen=True)
class FunctionCall:
    """One call the model made; answer it with `submit_tool_result(call_id, ...)`."""

    tick: int
    call_id: str
    name: str
    arguments: str  # a JSON object


@dataclass(frozen=True)
class ToolCallRejected:
    """The model's call could not be executed (malformed, unknown tool, too long); it gets an error result."""

    tick: int
    reason: str


@dataclass(frozen=True)
class ToolResultConsumed:
    """The results were prefilled and the audio that arrived meanwhile replayed: the session is live again."""

    tick: int
    call_ms: float  # tool-call start -> function calls emitted
    resume_ms: float  # last result submitted -> live again


@dataclass(frozen=True)
class SessionFailed:
    """The session was stopped by an error of its own; other sessions are unaffected."""

    tick: int
    message: str


Event = (
    TurnStarted
    | TurnEnded
    | ToolCallStarted
    | FunctionCall
    | ToolCallRejected
    | ToolResultConsumed
    | SessionFailed
)
Output = AudioFrame | Event


@dataclass(frozen=True)
class SubmitResult:
    """A room's answer to one of the model's tool calls (`SessionPort.submit_tool_result`)."""

    call_id: str
    output: str
    is_error: bool = False


@dataclass(frozen=True)
class ForceTokens:
    """Tokens the model is made to say on one channel, "text" or "function" (`force_text`,
    `force_function`)."""

    channel: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class PadBetween:
    """Pad the text channel between the forced turns, or stop (`pad_between`)."""

    on: bool


@dataclass(frozen=True)
class KeepPrivate:
    """Terms the engine keeps out of what it shows of the call (`keep_private`)."""

    terms: tuple[str, ...]


# what a room asks of its own session: through the door as engine/transport/wire.py encodes it, or on the
# session's queue in the engine's process
Request = SubmitResult | ForceTokens | PadBetween | KeepPrivate


@dataclass(frozen=True)
class Admit:
    """The worker's: a slot reserved for the job `admission` names (`Admissions.admit`)."""

    admission: str


@dataclass(frozen=True)
class Release:
    """The worker's: the slot reserved for the job `admission` names given back (`Admissions.release`)."""

    admission: str


@dataclass(frozen=True)
class AskLoad:
    """The worker's: the engine's load, free slots, whether its tick runs; `figures`: its figures too."""

    figures: bool = False  # engine/client/control.py `EngineFigures`: what the simulation reports


@dataclass(frozen=True)
class Drain:
    """The worker's: every room with a session told that the worker drains, its call `seconds` from ending."""

    seconds: float


@dataclass(frozen=True)
class ReportFleet:
    """The worker's new agents for rooms alone, by reason, for the engine's snapshot and /metrics."""

    redispatches: dict[str, int]


# what the worker asks of its engine, through the door's control key (engine/client/control.py)
Control = Admit | Release | AskLoad | Drain | ReportFleet


class SessionPort(Protocol):
    """What a room holds of its session: `engine/client/handle.py` `RemoteHandle` across the engine's door,
    `engine/tick/handle.py` `SessionHandle` in the engine's own process. Outputs arrive on `outputs` (or the
    sink the session was opened with) in tick order; nothing here waits on the tick."""

    id: str
    outputs: asyncio.Queue[list[Output]]

    @property
    def closed(self) -> bool: ...

    @property
    def frames_in(self) -> int: ...

    def push_audio(self, pcm: np.ndarray) -> None: ...

    def submit_tool_result(self, call_id: str, output: str, is_error: bool = False) -> None: ...

    def force_text(self, tokens: list[int] | str) -> None: ...

    def force_function(self, tokens: list[int] | str) -> None: ...

    def pad_between(self, on: bool = True) -> None: ...

    def keep_private(self, *terms: str) -> None: ...

    def report_playout(
        self, queued_s: float, gaps: int, gap_s: float, start_delay_s: float, turn_played_at: float = 0.0
    ) -> None: ...

    def report_receive(self, jitter_s: float, concealed_s: float) -> None: ...

    def close(self) -> None: ...


ToolSchemas = list[dict]  # the tools a session may call, as JSON schemas (agent/tool_schemas.py makes them)


class ClientConfig(Protocol):
    """The part of the engine's config a call reads."""

    preset: str
    max_result_chars: int
    fixed_buffers: bool


class ClientModelConfig(Protocol):
    clock: ClockConfig
    tokens: TokenConfig


class EngineClient(Protocol):
    """The engine as a room sees it: `engine/client/remote.py` `RemoteEngine` across the door, or
    `engine/tick/engine.py` `Engine` in the same process. `admission` names the job the worker reserved a
    slot for (`Admissions.admit`): the call's session takes that slot."""

    config: ClientConfig
    model_cfg: ClientModelConfig
    vocab_size: int

    @property
    def tokens(self) -> Tokens: ...

    def open_session(
        self,
        prompt: str,
        tools: ToolSchemas | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        label: str = "",
        caller: str = "",
        admission: str | None = None,
        context: str = "",
        trace: str = "",
    ) -> SessionPort: ...


class Admissions(Protocol):
    """The engine as the worker sees it when LiveKit offers a job: `engine/client/control.py` `EngineControl`
    across the door, or `Engine` in the same process. `admit` reserves a slot for the job (EngineFull,
    EngineOverloaded or EngineClosed otherwise) and returns its name, which the job's session names as its
    `admission`; `release` gives the slot back when the job ends before its session opens."""

    def admit(self, job: str) -> str: ...

    def release(self, admission: str) -> None: ...


class SessionSnapshot(BaseModel):
    id: str
    slot: int
    phase: str
    age_s: float
    frames_in: int
    frames_consumed: int
    frames_replayed: int
    underruns: int
    dropped_frames: int
    tool_calls: int
    tool_errors: int
    backlog_frames: int
    skipped_frames: int = 0  # held caller audio skipped by the catch-up policy (silence first)
    underrun_s: float = 0.0  # caller audio the model missed for want of a frame (underruns x the tick)
    reserve_frames: int = 0  # caller frames held after the last live tick took its own (the inbox's reserve)
    # the latency the engine sees: the last live frame's arrival (its room wrote it) to its output handed out
    heard_ms: float | None = None
    # the room's playout: audio queued ahead of the caller's ear, a turn's start delay, gaps this call
    playout_ms: float = 0.0
    start_delay_ms: float = 0.0
    playout_gaps: int = 0
    playout_gap_s: float = 0.0
    late_absorbed: int = 0  # the agent's frames that came late and that the playout's lead covered, this call
    # the room's receive side of the caller's audio: WebRTC's jitter buffer (NetEQ), its mean delay over the
    # last few seconds, and the audio it concealed (lost or late packets) this call; 0 until first read
    rx_jitter_ms: float = 0.0
    rx_concealed_s: float = 0.0
    # the agent's last turn: from the tick in which its text channel started it to its first sample handed to
    # the agent's track (the room's playout); None before a turn has played
    turn_start_ms: float | None = None
    label: str = ""  # the agent's name for the conversation (a room; numbers masked): opaque to the engine
    trace_id: str = ""  # the call's trace (32 hex digits, its room's W3C traceparent at open); "" when none
    caller: str = ""  # the caller's kind as the agent names it ("web", "phone")
    speaking: bool = False  # the agent is in a turn of its own
    calling: list[str] = []  # the tools of the call in progress (phases tool_call, waiting, prefill)
    turns: int = 0  # the agent's turns so far
    # the words of the agent's current or last turn (of its last SAID_PIECES text pieces,
    # engine/tick/slots.py)
    turn_words: int = 0
    # the end of the agent's current or last turn, redacted (redaction/), at most LAST_WORDS
    # characters; "" unless the engine shows words (`EngineSnapshot.show_words`)
    last_words: str = ""


class ToolCallSnapshot(BaseModel):
    """One finished tool call (the latest CALL_LOG of them are kept)."""

    session: str
    label: str = ""
    names: list[str]  # empty when the model's call could not be read
    ok: bool  # every result came back without an error
    at: float  # wall-clock time (Unix seconds) the session was live again
    call_ms: float  # start of call -> function calls emitted (the model writing the call)
    tool_ms: float  # function calls emitted -> the last result submitted (the tool's own time)
    resume_ms: float  # last result -> live again (result prefill and replay)


class EngineSnapshot(BaseModel):
    preset: str
    device: str
    num_slots: int
    occupancy: float
    ticks: int
    live_ms_p50: float
    live_ms_p99: float
    live_ms_max: float
    missed_deadlines: int  # ticks whose frames were out after the tick's deadline
    overruns: int = 0  # ticks whose work (the progress guarantee included) ran past the deadline
    slipped_ticks: int = 0  # ticks the clock skipped after falling more than a tick behind
    overloaded: bool = False  # new sessions are being refused for lack of headroom
    refused_sessions: int = 0
    dropped_frames: int
    skipped_frames: int = 0
    underruns: int
    tool_calls: int
    tool_call_ms_p50: float
    tool_call_ticks_p50: float
    resume_ms_p50: float
    phases: dict[str, int]
    sessions: list[SessionSnapshot]
    recent_tick_ms: list[float]
    # what the sessions' `last_words` carry: "off" (nothing: counts only) or "redacted" (EngineConfig)
    show_words: str = "off"
    at: float = 0.0  # wall-clock time (Unix seconds) of the snapshot
    tick_budget_ms: float = 80.0
    # how much earlier than its nominal time each tick starts, moved toward the callers' frames' arrivals
    # (engine/tick/phase.py)
    tick_shift_ms: float = 0.0
    # ticks that started before their time within the margin they keep for late frames, every frame they take
    # in already (engine.py `_loop`), and how early on average
    early_ticks: int = 0
    tick_early_ms: float = 0.0
    # the tick thread runs at a real-time priority (EngineConfig.tick_priority, engine/process/priority.py)
    tick_realtime: bool = False
    # the live step over the accounting window (minutes), one point per `history_step_s`: its max and median
    history_step_s: float = 0.96
    history_max_ms: list[float] = []
    history_p50_ms: list[float] = []
    memory_bytes: int = 0  # CUDA: allocated on the device; CPU: the process's resident memory
    memory_total_bytes: int = 0  # the device's (or the machine's) memory
    tool_log: list[ToolCallSnapshot] = []  # the latest finished tool calls, newest last
    echo: dict | None = (
        None  # echo mode only (a measurement tool): marked frames' timings (engine/tick/echo.py)
    )
    # values rooms wrote to their shared memory that were not plausible, left out (engine/transport/link.py)
    shared_memory_rejected: int = 0
    # rooms with a caller and no live agent for which the worker asked for a new agent, by reason
    # (agent/fleet/fleet.py; reported by the worker through the engine's door)
    redispatches: dict[str, int] = {}
    # the tick's ledger (engine/tick/ledger.py `report`, docs/monitoring.md): side pieces' predicted and
    # measured ms by bucket, the tick's parts, the late ticks and what ran in them
    tick_ledger: dict | None = None
