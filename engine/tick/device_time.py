"""Time on the device the tick's work runs on: CUDA events on a GPU, the wall clock on a CPU, one interface.

A GPU runs what the host launched later, in order: a piece of work returns to the host once it is queued,
and its cost is paid at the next read back (the live step's copy to the host, a tool-call step's tokens). A
piece's time is then its device time, read from marks recorded in the device's queue before and after it,
never the host's time around its launch. `mark` records one (on CUDA an event from a ring made once, so no
mark allocates or waits); `elapsed_ms` reads two once the device has passed them; `fence` waits for the
device to finish everything queued (the end of a tick's slack work, outside the live step). On a CPU every
piece is done when it returns: marks are the wall clock and the fence does nothing.

Used by the runner (engine/tick/runner.py); knows nothing of what the work is.
"""

from __future__ import annotations

import time

import torch

RING = 1024  # CUDA events reused round the ring: far more than the marks of one tick (two a step)


class WallTimes:
    """The CPU: work is synchronous, so the wall clock times it."""

    asynchronous = False

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def fence(self) -> None:
        pass


class CudaTimes:
    """A GPU's current stream: marks are CUDA events recorded in it (read only after a read back or the
    fence has passed them: `elapsed_time` of an event not yet reached would wait)."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(RING)]
        self._next = 0
        self._last: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event:
        event = self._events[self._next]
        self._next = (self._next + 1) % RING
        event.record()
        self._last = event
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def fence(self) -> None:
        if self._last is not None:
            self._last.synchronize()


def device_times(device: torch.device):
    """The marks of `device`: CUDA events on a GPU, the wall clock elsewhere."""
    return CudaTimes(device) if device.type == "cuda" else WallTimes()
