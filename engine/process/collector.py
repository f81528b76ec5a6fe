"""The process's garbage collector, owned here: the thresholds and freezes that keep long-lived objects out of
its way, and the tick thread's full collections, about once a minute in a tick's slack when it fits.

The objects of a turn or a tool call live for seconds, long enough to reach the collector's oldest generation,
whose own passes are rare (`freeze_long_lived`), so their reference cycles would otherwise never be freed.
The model and other long-lived objects are frozen (`gc.freeze` at engine start), so a pass walks only what
came since; still, on a busy CPU it can outlast a tick, and one that finds no room for FORCE_AFTER of its
periods runs anyway: bounded memory is worth one late tick.
Knows the collector and the clock; nothing of the model.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("chorus.engine")

EVERY_S = 60.0  # a full collection this often, in a tick's slack
FORCE_AFTER = 3  # ...and without slack after this many periods


THRESHOLDS = (50_000, 20, 100)  # young collections rarely, and the oldest generation's own passes rarer still

_lock = threading.Lock()
_frozen = False  # a first freeze happened in this process (and unfreeze is registered for its exit)


def freeze_long_lived(again: bool = False) -> None:
    """Long-lived objects (the model, sessions' setup, a job process's modules) out of the collector's way: a
    full collection holds the GIL for tens of milliseconds, and the tick thread waits for it. Sets the
    thresholds, then collects and freezes what is alive: once per process, or `again` (the engine after
    building a model; a run once its rooms are set up). Any thread; the agent calls it through here only."""
    global _frozen
    gc.set_threshold(*THRESHOLDS)
    with _lock:
        if _frozen and not again:
            return
        if not _frozen:
            atexit.register(gc.unfreeze)  # frozen objects would outlive the interpreter's own cleanup
        _frozen = True
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """What was frozen is the collector's again (a run that closed its engine and rooms)."""
    gc.unfreeze()


class Collector:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last = clock()  # the last full collection
        self.expected_ms = 5.0  # what one is expected to cost (learned)
        self.runs = 0

    def maybe_collect(self, next_start: float) -> bool:
        """Collect if one is due and fits before `next_start` (the next tick's start, on the same clock), or
        is overdue; True if it ran."""
        now = self.clock()
        since = now - self.last
        if since < EVERY_S:
            return False
        room = next_start - now
        if room < 1.5 * self.expected_ms / 1000 + 0.002 and since < FORCE_AFTER * EVERY_S:
            return False
        gc.collect()
        self.last = self.clock()
        ms = (self.last - now) * 1e3
        self.expected_ms = max(ms, 0.7 * self.expected_ms + 0.3 * ms)
        self.runs += 1
        log.debug("full collection in %.1f ms (%.1f ms of room)", ms, room * 1e3)
        return True
