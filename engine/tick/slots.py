"""Slots and what feeds the sessions that hold them: the pool's free list and reservations, each session's
inbox of caller frames (the session itself is engine/tick/session.py).

Thread-safe where other threads touch it (push_audio, open, close, reserve); everything else is read and
written by the tick thread only. Knows numpy and the engine contract; knows nothing of the model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine.api import EngineFull
from redaction import opaque_id

if TYPE_CHECKING:
    from engine.tick.session import Session

SILENT_RMS = 0.003  # a frame quieter than this (about -50 dBFS) is silence: the first audio skipped


class FrameInbox:
    """Caller audio of any chunk size, cut into exact frames; bounded (oldest frames dropped and counted).

    Each frame remembers whether it is silent, so held audio that cannot be caught up in time is skipped
    silence first (`skip`), and when it arrived (`clock`, or the time its room wrote it), so the engine sees
    how long a frame waited: `popped_at` is the arrival of the frame the last `pop` returned (None: no frame),
    `held` the frames left behind it."""

    def __init__(self, frame: int, max_frames: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.frame = frame
        self.max_frames = max_frames
        self._clock = clock
        self._lock = threading.Lock()
        self._tail = np.zeros(0, dtype=np.float32)
        self._frames: deque[tuple[np.ndarray, bool, float]] = deque()  # (samples, silent, arrived)
        self.popped_at: float | None = None
        self.held = 0
        self.frames_in = 0
        # where frames come from besides `push`: a room's ring in shared memory (engine/door/host.py), read by
        # the tick thread once a tick through `pull`; and whether it holds a frame not yet pulled (`fresh`)
        self.source: Callable[[FrameInbox], None] | None = None
        self.pending: Callable[[], bool] | None = None
        self._pulled = 0  # frames_in at the last pull
        self.dropped = 0  # oldest frames pushed out of a full inbox
        self.skipped = 0  # frames skipped by the catch-up policy
        self.nonfinite = 0

    def push(self, pcm: np.ndarray, at: np.ndarray | None = None) -> None:
        """Samples of any length (`at`: when each whole frame of them arrived, for exact frames; else now)."""
        a = np.asarray(pcm)
        if a.ndim != 1:
            raise ValueError(f"push_audio: expected mono samples of shape (n,), got shape {a.shape}")
        if a.dtype == np.int16:
            x = a.astype(np.float32) / 32768.0
            bad = np.zeros(0, dtype=bool)
        elif np.issubdtype(a.dtype, np.floating):
            # clipped in the caller's precision first: a finite 1e39 in float64 is loud, not infinity
            bad = ~np.isfinite(a)
            x = np.clip(np.where(bad, 0.0, a) if bad.any() else a, -1.0, 1.0).astype(np.float32)
        else:
            raise ValueError(f"push_audio: expected int16 or float samples, got {a.dtype}")
        with self._lock:
            self.nonfinite += int(bad.sum())
            buf = np.concatenate([self._tail, x]) if self._tail.size else x
            n = buf.size // self.frame
            if n:
                cut = buf[: n * self.frame].reshape(n, self.frame)
                silent = np.sqrt(np.mean(np.square(cut), axis=1)) < SILENT_RMS
                when = at.tolist() if at is not None and at.size == n else [self._clock()] * n
                self._frames.extend(zip(cut, silent.tolist(), when, strict=True))
            self._tail = buf[n * self.frame :].copy()
            self.frames_in += n
            while len(self._frames) > self.max_frames:
                self._frames.popleft()
                self.dropped += 1

    def pull(self) -> None:
        """Take in what the source has written since the last pull (the tick thread, once a tick)."""
        if self.source is not None:
            self.source(self)
        self._pulled = self.frames_in

    def fresh(self) -> bool:
        """Whether a whole frame has come since the last pull (pushed, or waiting in the source)."""
        return self.frames_in > self._pulled or (self.pending is not None and self.pending())

    def pop(self) -> np.ndarray | None:
        with self._lock:
            if not self._frames:
                self.popped_at, self.held = None, 0
                return None
            samples, _, self.popped_at = self._frames.popleft()
            self.held = len(self._frames)
            return samples

    def skip(self, n: int, *, silent_only: bool = False, keep: int = 2) -> int:
        """Skip up to `n` held frames, never the newest `keep`: silent frames first (oldest first), then,
        unless `silent_only`, the oldest. Returns how many were skipped (also counted in `skipped`)."""
        with self._lock:
            frames = list(self._frames)
            head, tail = frames[: max(0, len(frames) - keep)], frames[max(0, len(frames) - keep) :]
            n = min(n, len(head))
            if n <= 0:
                return 0
            drop = [i for i, (_, silent, _) in enumerate(head) if silent][:n]
            if len(drop) < n and not silent_only:
                loud = [i for i, (_, silent, _) in enumerate(head) if not silent]
                drop += loud[: n - len(drop)]
            gone = set(drop)
            self._frames = deque([f for i, f in enumerate(head) if i not in gone] + tail)
            self.skipped += len(gone)
            return len(gone)

    def __len__(self) -> int:
        return len(self._frames)


class SlotPool:
    """A fixed number of slots, a free list, and the sessions holding them."""

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_slots = num_slots
        self.clock = clock  # the engine's: reservations lapse on it
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_slots))
        self.sessions: dict[int, Session] = {}
        self._to_reset: set[int] = set()  # opened since the last tick: the model must reset these rows
        self._closed: list[Session] = []  # closed since the last tick (their final counters)
        self._reserved: dict[str, float] = {}  # job a slot is reserved for -> when it lapses (on the clock)

    @property
    def occupancy(self) -> float:
        """The share of slots held by sessions (reserved ones not counted: LiveKit's worker counts the jobs it
        accepted itself, until they run)."""
        with self._lock:
            return (self.num_slots - len(self._free)) / self.num_slots

    @property
    def available(self) -> int:
        """Slots neither held by a session nor reserved for an admitted caller."""
        with self._lock:
            return len(self._free) - self._held(self.clock())

    def _held(self, now: float) -> int:
        """Reservations still unexpired (the lock held); expired ones are dropped."""
        for job, until in list(self._reserved.items()):
            if until <= now:
                del self._reserved[job]
        return len(self._reserved)

    def reserve(self, job: str, ttl_s: float) -> str:
        """Promise a slot to `job` for `ttl_s` seconds, or EngineFull; the job's name, which `open` redeems.
        Admission decides once, when a caller is accepted; the session that follows within the reservation's
        life gets its slot. A job reserved again keeps its one slot, for `ttl_s` from now."""
        with self._lock:
            now = self.clock()
            if job not in self._reserved and len(self._free) - self._held(now) <= 0:
                raise EngineFull(self._full())
            self._reserved[job] = now + ttl_s
            return job

    def holds(self, job: str) -> bool:
        """Whether a slot is reserved for `job` (not yet redeemed, released or lapsed)."""
        with self._lock:
            self._held(self.clock())
            return job in self._reserved

    def release(self, job: str) -> None:
        """Give an unredeemed reservation back (the caller never came)."""
        with self._lock:
            self._reserved.pop(job, None)

    def _full(self) -> str:
        return f"all {self.num_slots} slots are in use; route the caller to another worker or retry later"

    def open(self, make: Callable[[str, int], Session], job: str | None = None) -> Session:
        """A slot for a new session: the one reserved for `job`, or a free slot no reservation holds."""
        with self._lock:
            redeemed = job is not None and self._reserved.pop(job, None) is not None
            if not self._free or (not redeemed and len(self._free) - self._held(self.clock()) <= 0):
                raise EngineFull(self._full())
            slot = self._free.popleft()
            session = make(opaque_id(), slot)
            self.sessions[slot] = session
            self._to_reset.add(slot)
            return session

    def close(self, session: Session) -> None:
        """The slot is free at once: a caller waiting for one gets it now. The tick in progress skips the
        closed session, and the slot's rows are reset before a new session's first step."""
        with self._lock:
            if session.closed:
                return
            session.closed = True
            if self.sessions.get(session.slot) is session:
                del self.sessions[session.slot]
                self._free.append(session.slot)
            self._closed.append(session)

    def begin_tick(self) -> tuple[np.ndarray, list[Session], list[Session]]:
        """The reset mask (slots opened since the last tick), the sessions now open and the sessions closed
        since the last tick (for their final counters)."""
        reset = np.zeros(self.num_slots, dtype=bool)
        with self._lock:
            freed, self._closed = self._closed, []
            for slot in self._to_reset:
                reset[slot] = True
            self._to_reset.clear()
            live = list(self.sessions.values())
        return reset, live, freed
