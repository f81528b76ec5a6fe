"""Slots and the sessions that hold them: the pool's free list, each session's phase, inbox and counters.

Thread-safe where other threads touch it (push_audio, submit_tool_result, open, close); everything else is
read and written by the tick thread only. Knows numpy and the engine contract; knows nothing of the model.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.api import EngineFull, Output
from engine.tokens import ParsedCall


class Phase(enum.Enum):
    PROMPT = "prompt"  # system prompt being prefilled (in the slack)
    LIVE = "live"  # in the live batch: hears 80 ms, says 80 ms per tick
    TOOL_CALL = "tool_call"  # paused; tool-call tokens generated unpaced (in the slack)
    WAITING = "waiting"  # paused; function calls emitted, waiting for results
    PREFILL = "prefill"  # paused; results being prefilled in chunks (in the slack)
    REPLAY = "replay"  # caller audio that arrived meanwhile fed faster than real time, agent silent


PAUSED = (Phase.TOOL_CALL, Phase.WAITING, Phase.PREFILL, Phase.REPLAY)


class FrameInbox:
    """Caller audio of any chunk size, cut into exact frames; bounded (oldest frames dropped and counted)."""

    def __init__(self, frame: int, max_frames: int) -> None:
        self.frame = frame
        self.max_frames = max_frames
        self._lock = threading.Lock()
        self._tail = np.zeros(0, dtype=np.float32)
        self._frames: deque[np.ndarray] = deque()
        self.frames_in = 0
        self.dropped = 0
        self.nonfinite = 0

    def push(self, pcm: np.ndarray) -> None:
        a = np.asarray(pcm)
        if a.ndim != 1:
            raise ValueError(f"push_audio: expected mono samples of shape (n,), got shape {a.shape}")
        if a.dtype == np.int16:
            x = a.astype(np.float32) / 32768.0
        elif a.dtype in (np.float32, np.float64):
            x = a.astype(np.float32)
        else:
            raise ValueError(f"push_audio: expected int16 or float samples, got {a.dtype}")
        bad = ~np.isfinite(x)
        if bad.any():
            x = np.where(bad, 0.0, x).astype(np.float32)
        with self._lock:
            self.nonfinite += int(bad.sum())
            buf = (
                np.concatenate([self._tail, np.clip(x, -1.0, 1.0)])
                if self._tail.size
                else np.clip(x, -1.0, 1.0)
            )
            n = buf.size // self.frame
            for i in range(n):
                self._frames.append(buf[i * self.frame : (i + 1) * self.frame])
            self._tail = buf[n * self.frame :].copy()
            self.frames_in += n
            while len(self._frames) > self.max_frames:
                self._frames.popleft()
                self.dropped += 1

    def pop(self) -> np.ndarray | None:
        with self._lock:
            return self._frames.popleft() if self._frames else None

    def __len__(self) -> int:
        return len(self._frames)


@dataclass
class Session:
    """Engine-side state of one conversation (the tick thread's view)."""

    id: str
    slot: int
    tools: frozenset[str]
    inbox: FrameInbox
    deliver: Callable[[list[Output]], None]
    phase: Phase = Phase.PROMPT
    # the ids a PROMPT or PREFILL phase still has to prefill, and how far it got
    prefill_ids: list[int] = field(default_factory=list)
    prefill_pos: int = 0
    prompt_key: int = 0  # sessions with the same prompt share one prefill
    # teacher forcing: tokens that replace the model's own, one per position, per channel
    force_text: deque[int] = field(default_factory=deque)
    force_func: deque[int] = field(default_factory=deque)
    # the tool call in progress
    call_tokens: list[int] = field(default_factory=list)
    pending: dict[str, ParsedCall] = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)
    incoming: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    wait_deadline: float = 0.0
    t_call_start: float = 0.0
    call_ms: float = 0.0
    t_last_result: float = 0.0
    # counters
    frames_consumed: int = 0
    frames_replayed: int = 0
    underruns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    speaking: bool = False
    closed: bool = False
    opened_at: float = field(default_factory=time.monotonic)


class SlotPool:
    """A fixed number of slots, a free list, and the sessions holding them."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_slots))
        self.sessions: dict[int, Session] = {}
        self._to_reset: set[int] = set()  # opened since the last tick: the model must reset these rows
        self._to_free: set[int] = set()  # closed since the last tick: freed by the tick thread

    @property
    def occupancy(self) -> float:
        with self._lock:
            return (self.num_slots - len(self._free)) / self.num_slots

    def open(self, make: Callable[[str, int], Session]) -> Session:
        with self._lock:
            if not self._free:
                raise EngineFull(
                    f"all {self.num_slots} slots are in use; route the caller to another worker or retry later"
                )
            slot = self._free.popleft()
            session = make(uuid.uuid4().hex[:12], slot)
            self.sessions[slot] = session
            self._to_reset.add(slot)
            return session

    def close(self, session: Session) -> None:
        with self._lock:
            if session.closed:
                return
            session.closed = True
            self._to_free.add(session.slot)

    def begin_tick(self) -> tuple[np.ndarray, list[Session]]:
        """Free the slots closed since the last tick; return the reset mask and the sessions now open."""
        reset = np.zeros(self.num_slots, dtype=bool)
        with self._lock:
            for slot in self._to_free:
                self.sessions.pop(slot, None)
                self._free.append(slot)
                self._to_reset.discard(slot)
            self._to_free.clear()
            for slot in self._to_reset:
                reset[slot] = True
            self._to_reset.clear()
            live = list(self.sessions.values())
        return reset, live
