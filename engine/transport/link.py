"""A session's shared memory between the engine's process and the room's process that holds the call.

One anonymous memory file (memfd) per session, mapped by both sides and handed to the room with its socket
(engine/door/host.py, engine/client/remote.py). It holds two rings of fixed-size frames, four counters and the
room's playout figures:

- caller frames in: `in_frames` int16 frames of the engine's input frame (1280 samples at 16 kHz), each with
  the time the room wrote it (CLOCK_MONOTONIC seconds); the room writes a frame and its time, then advances
  `in_w`; the engine takes what lies between its own `in_r` and `in_w` once a tick and publishes `in_r`, and
  beside it when it took them (`taken_at`, CLOCK_MONOTONIC seconds, float64): the room's native caller
  audio times its frames against the ticks with it (agent/audio_in/native/audio_pump.c, aligning).
- agent frames out: `out_frames` records of one engine output frame (float32 samples), its tick, its text
  piece (UTF-8, at most TEXT_BYTES) and how many of the session's events (sent on the socket) come before it;
  the engine writes a record, then advances `out_w`; the room reads up to `out_w` and publishes `out_r`.
- the room's playout (`playout`, float64, written by the room, read for the snapshot): the audio queued ahead
  of the caller's ear, its gaps so far and their seconds, the turn's start delay, when the last turn's
  first sample went to the agent's track (CLOCK_MONOTONIC seconds), the late frames it absorbed without a
  gap, and the room's receive side of the
  caller's audio: WebRTC's jitter buffer's mean delay lately and the audio it concealed (PLAYOUT_FIELDS).
  A room may write anything there: the reading side keeps only what `check_playout` finds plausible.

Each counter has one writer and counts frames since the session opened (a ring index is the counter modulo
the ring's size), so neither side ever waits on the other: a room that falls behind finds its records
overwritten (the engine never blocks), and an engine that stops taking frames leaves the room's ring full
(the room drops and counts). A counter is one aligned 8-byte store, written after the frame it publishes.
Knows numpy and mmap; nothing of LiveKit, the model or the tick.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import numpy as np

MAGIC = 0x43484F5255530005  # "CHORUS" and the layout's version
LINE = 64  # each counter on a cache line of its own
IN_W, IN_R, OUT_W, OUT_R = 0, 1, 2, 3  # counters, by their line
TAKEN_AT = IN_R * LINE + 8  # byte offset of the engine's last take (float64), on the read counter's line
DESCRIPTION, PLAYOUT = 4, 5  # the layout's description, the room's playout figures: by their line
HEADER_LINES = 6
PLAYOUT_FIELDS = (
    "queued_s",
    "gaps",
    "gap_s",
    "start_delay_s",
    "turn_played_at",
    "late_absorbed",
    "rx_jitter_s",
    "rx_concealed_s",
)
RECEIVE_AT = PLAYOUT_FIELDS.index("rx_jitter_s")  # the playout's figures before it, the receive side's after
PLAYED_AT = PLAYOUT_FIELDS.index("turn_played_at")
# what a room can plausibly write there, for the side that reads it (`check_playout`): audio held in a buffer
# (queued, a turn's start delay, WebRTC's jitter buffer) is under a minute; this call's totals are those of a
# call shorter than a day, a gap at most every 10 ms of it; a turn played (CLOCK_MONOTONIC) within that day
# before the read, or not yet (0)
HELD_MAX_S = 60.0
CALL_MAX_S = 86_400.0
PLAYOUT_MAX = np.array(
    [HELD_MAX_S, CALL_MAX_S * 100, CALL_MAX_S, HELD_MAX_S, np.inf, CALL_MAX_S * 100, HELD_MAX_S, CALL_MAX_S]
)
CLOCK_SLACK_S = 1.0  # a time the room read before the engine's read, allowed this much ahead of it
IN_FRAMES = 64  # 5.1 s of caller audio at 80 ms
OUT_FRAMES = 64
TEXT_BYTES = 120  # a frame's text piece: one token's characters, a few at most
# an out record's int64 fields, after its samples: tick, events before it, text length
TICK, EVENTS, TEXT_LEN = 0, 1, 2
META = 3


@dataclass(frozen=True)
class Layout:
    """Where everything lies in a session's shared memory, for one engine clock."""

    in_samples: int
    out_samples: int
    in_frames: int = IN_FRAMES
    out_frames: int = OUT_FRAMES

    @property
    def in_offset(self) -> int:
        return HEADER_LINES * LINE

    @property
    def out_record(self) -> int:
        """Bytes of one out record: samples, the int64 fields, the text (8-byte aligned)."""
        return -(-(4 * self.out_samples + 8 * META + TEXT_BYTES) // 8) * 8

    @property
    def stamp_offset(self) -> int:
        return -(-(self.in_offset + 2 * self.in_samples * self.in_frames) // LINE) * LINE

    @property
    def out_offset(self) -> int:
        return -(-(self.stamp_offset + 8 * self.in_frames) // LINE) * LINE

    @property
    def size(self) -> int:
        return self.out_offset + self.out_record * self.out_frames

    def describe(self) -> np.ndarray:
        return np.array([MAGIC, self.in_samples, self.out_samples, self.in_frames, self.out_frames], np.int64)


@dataclass(frozen=True)
class CallerRing:
    """Where a session's caller ring lies in this process: the mapping's address and the byte offsets of the
    write and read counters, the frames and their write times. For a writer outside Python (the room's native
    caller audio, agent/audio_in/audio_pump.py), which must stop writing before the mapping is closed."""

    base: int
    in_w: int
    in_r: int
    frames_at: int
    stamps_at: int
    frames: int
    samples: int
    taken_at: int = TAKEN_AT


def check_playout(rows: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
    """Rooms' playout figures as read, `[n, len(PLAYOUT_FIELDS)]` float64 (a copy: the rooms write on),
    checked against what a room can plausibly report at `now` (CLOCK_MONOTONIC seconds, `turn_played_at`'s
    clock): the figures with every implausible value NaN, and which those were (`[n, F]` bool). Implausible:
    not finite, negative, beyond its field's PLAYOUT_MAX, or a `turn_played_at` neither 0 (no turn yet) nor
    within CALL_MAX_S before `now` (CLOCK_SLACK_S after it at most). In array operations over every row."""
    x = np.asarray(rows, np.float64).reshape(-1, len(PLAYOUT_FIELDS))
    ok = (x >= 0) & (x <= PLAYOUT_MAX)  # False for NaN
    played = x[:, PLAYED_AT]
    ok[:, PLAYED_AT] &= (played == 0) | ((played >= now - CALL_MAX_S) & (played <= now + CLOCK_SLACK_S))
    return np.where(ok, x, np.nan), ~ok


class LinkError(ValueError):
    """A session's shared memory is not what this side expects."""


class SessionLink:
    """Views over one session's shared memory (either side's). `create` makes a new one (the engine's side);
    `attach` maps one received from the engine (the room's side), checking its size and layout."""

    def __init__(self, fd: int, layout: Layout, mm: mmap.mmap) -> None:
        self.fd, self.layout, self._mm = fd, layout, mm
        lay = layout
        self.counters = np.ndarray((DESCRIPTION, LINE // 8), np.int64, mm, 0)[:, 0]
        self.description = np.ndarray(5, np.int64, mm, DESCRIPTION * LINE)
        self.taken_at = np.ndarray(1, np.float64, mm, TAKEN_AT)
        self.playout = np.ndarray(len(PLAYOUT_FIELDS), np.float64, mm, PLAYOUT * LINE)
        self.caller = np.ndarray((lay.in_frames, lay.in_samples), np.int16, mm, lay.in_offset)
        self.stamps = np.ndarray(lay.in_frames, np.float64, mm, lay.stamp_offset)
        rec = lay.out_record
        self.agent = np.ndarray(
            (lay.out_frames, lay.out_samples), np.float32, mm, lay.out_offset, strides=(rec, 4)
        )
        self.meta = np.ndarray(
            (lay.out_frames, META), np.int64, mm, lay.out_offset + 4 * lay.out_samples, strides=(rec, 8)
        )
        self.text = np.ndarray(
            (lay.out_frames, TEXT_BYTES),
            np.uint8,
            mm,
            lay.out_offset + 4 * lay.out_samples + 8 * META,
            strides=(rec, 1),
        )

    @classmethod
    def create(cls, layout: Layout) -> SessionLink:
        fd = os.memfd_create("chorus-session", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.size)
            mm = mmap.mmap(fd, layout.size)
        except BaseException:
            os.close(fd)
            raise
        link = cls(fd, layout, mm)
        link.description[:] = layout.describe()
        return link

    @classmethod
    def attach(cls, fd: int, layout: Layout) -> SessionLink:
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise LinkError(f"shared memory of {size} bytes, expected {layout.size}")
        link = cls(fd, layout, mmap.mmap(fd, layout.size))
        if not np.array_equal(link.description, layout.describe()):
            link.close()
            raise LinkError("shared memory of another layout")
        return link

    def forget_fd(self) -> None:
        """Close the descriptor; the mapping stays as long as this object (and any view of it) lives."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def get(self, counter: int) -> int:
        return int(self.counters[counter])

    def set(self, counter: int, value: int) -> None:
        self.counters[counter] = value

    # -- the engine's side: caller frames out of the ring, agent frames into it ----------------------------

    def take_caller(self, r: int, now: float) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The caller frames written since counter `r`, as `[n, in_samples]` int16, and when each was
        written; the new counter (also published to the room, with `now` as the take's time); the frames
        lost: written beyond what the ring holds, or -1 for a counter that went back (nothing of the ring is
        trusted then, and reading starts again from where it is)."""
        self.taken_at[0] = now
        w = self.get(IN_W)
        if w == r:
            return self.caller[:0], self.stamps[:0], r, 0
        if w < r:
            self.set(IN_R, w)
            return self.caller[:0], self.stamps[:0], w, -1
        frames = self.layout.in_frames
        lost = max(0, w - r - frames)
        at = np.arange(r + lost, w) % frames
        taken, stamps = self.caller[at], self.stamps[at]
        self.set(IN_R, w)
        return taken, stamps, w, lost

    def put_agent(self, w: int, samples: np.ndarray, text: str, tick: int, events: int) -> None:
        """Record `w` (the counter's value): one output frame, its text (cut on a character's boundary to
        TEXT_BYTES), its tick and the number of events before it; then the counter moves past it."""
        i = w % self.layout.out_frames
        self.agent[i] = samples
        data = text.encode()
        if len(data) > TEXT_BYTES:
            data = data[:TEXT_BYTES].decode(errors="ignore").encode()
        self.text[i, : len(data)] = np.frombuffer(data, np.uint8)
        self.meta[i, TICK], self.meta[i, EVENTS], self.meta[i, TEXT_LEN] = tick, events, len(data)
        self.set(OUT_W, w + 1)

    # -- the room's side: caller frames into the ring, agent frames out of it ------------------------------

    def put_caller(self, w: int, frame: np.ndarray, at: float) -> bool:
        """Caller frame `w` (the counter's value) into the ring with the time it arrived (`at`,
        time.monotonic), then the counter past it; False (nothing written) while the ring is full."""
        frames = self.layout.in_frames
        if w - self.get(IN_R) >= frames:
            return False
        self.caller[w % frames] = frame
        self.stamps[w % frames] = at
        self.set(IN_W, w + 1)
        return True

    def caller_ring(self) -> CallerRing:
        """The caller ring's place in memory, for a writer outside Python (it takes over the write counter
        from its value now)."""
        lay = self.layout
        base = self.counters.ctypes.data  # the mapping's first byte
        return CallerRing(
            base, IN_W * LINE, IN_R * LINE, lay.in_offset, lay.stamp_offset, lay.in_frames, lay.in_samples
        )

    def events_before(self, r: int) -> int:
        """How many of the session's events came before agent record `r`."""
        return int(self.meta[r % self.layout.out_frames, EVENTS])

    def read_agent(self, r: int) -> tuple[int, np.ndarray, str] | None:
        """Agent record `r` as (tick, samples, text), or None when the engine overwrote it before or while it
        was read (the room fell a ring behind)."""
        i = r % self.layout.out_frames
        n = max(0, min(int(self.meta[i, TEXT_LEN]), TEXT_BYTES))
        tick, samples = int(self.meta[i, TICK]), self.agent[i].copy()
        text = bytes(self.text[i, :n]).decode(errors="replace")
        if self.get(OUT_W) - r > self.layout.out_frames:
            return None
        return tick, samples, text

    def close(self) -> None:
        """Unmap now (the room's side, when its session is over and nothing reads the views)."""
        self.forget_fd()
        self.counters = self.description = self.caller = self.agent = self.meta = self.text = None
        self.playout = self.stamps = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
            self._mm.close()
