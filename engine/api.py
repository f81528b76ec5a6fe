"""The engine contract as `agent/` sees it: errors, per-tick outputs and session events.

Plain data only: no tensors, no threads. Everything a session receives from the tick thread is one of the
types below, delivered in tick order on the session's own event loop (or to its sink).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    text: str = ""  # the text channel's piece for this frame ("" when silent or a control token)


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
