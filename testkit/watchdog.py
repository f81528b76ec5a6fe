"""A long run that fails instead of hanging (benchmarks/soak.py): a thread of its own that looks at the run's
progress every second (whatever the run counts: calls answered, frames its callers heard) and, once nothing
has moved for `stall_s`, writes every thread's stack and ends the process.

It ends the process itself (`os._exit`) because a stalled run's own threads cannot be relied on to: the
soak's generator once hung with its main thread waiting on a lock that same thread held (a finalizer
re-entering the rtc event router), where no exception and no SIGTERM could reach it. Before that it runs
`on_stall`, which the run gives to stop what it started (its workers) and to leave its report.

Should the watchdog's own thread be kept from running at all (a native library holding the interpreter's
lock), `faulthandler`'s timer, which needs no Python thread, writes the stacks and exits with status 1 once
no look has been taken for `stall_s`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

STALL_S = 60.0  # nothing progressed this long: the run has hung
EVERY_S = 1.0  # how often progress is looked at
STALLED = 3  # the exit status of a run ended for its stall


def thread_stacks() -> str:
    """Every thread's stack, named, the most recent call last (as a traceback reads)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, '(not started by threading)')} ({ident:#x}):\n{stack}")
    return "\n".join(parts)


class Watchdog:
    """Fails a run whose `progress()` (any value that changes while the run moves on, e.g. a tuple of
    counts) has not changed for `stall_s`: writes "watchdog: {what} progressed for N s" and every thread's
    stack to `out` (stderr), calls
    `on_stall` with that text, then exits the process with `exit_status` (None: it does not, for tests).

    `check()` is one look (`clock` gives its time); `start()` takes one every `every_s` on a daemon thread,
    `stop()` ends them. `progress` runs on that thread, beside the run's: it only reads, and one that raises
    counts as nothing new."""

    def __init__(
        self,
        progress: Callable[[], Any],
        stall_s: float = STALL_S,
        *,
        what: str = "nothing",
        on_stall: Callable[[str], None] | None = None,
        exit_status: int | None = STALLED,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = EVERY_S,
    ) -> None:
        if stall_s <= 0 or every_s <= 0:
            raise ValueError(f"stall_s and every_s must be above 0 (got {stall_s}, {every_s})")
        self.progress, self.stall_s, self.what = progress, stall_s, what
        self.on_stall, self.exit_status, self.out = on_stall, exit_status, out
        self.clock, self.every_s = clock, every_s
        self.report: str | None = None  # what was written, once stalled
        self._last: Any = None
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop = False

    def check(self) -> bool:
        """One look: True while the run progresses or has not yet been still for `stall_s`; False once
        stalled (reported, `on_stall` called, the process exited unless `exit_status` is None)."""
        if self.report is not None:
            return False
        now = self.clock()
        try:
            value = self.progress()
        except Exception:  # noqa: BLE001 (a count read mid-change: nothing new this time)
            value = self._last
        if self._since is None or value != self._last:
            self._last, self._since = value, now
            return True
        if now - self._since < self.stall_s:
            return True
        self._stalled(now - self._since)
        return False

    def _stalled(self, still_s: float) -> None:
        self._disarm_backstop()
        self.report = (
            f"watchdog: {self.what} progressed for {still_s:.0f} s (last seen: {self._last!r}); "
            f"every thread's stack:\n{thread_stacks()}"
        )
        out = self.out or sys.stderr
        with contextlib.suppress(OSError, ValueError):
            out.write(self.report + "\n")
            out.flush()
        if self.on_stall is not None:
            try:
                self.on_stall(self.report)
            except Exception:  # noqa: BLE001 (the stall is the failure: it is reported and the run ends)
                with contextlib.suppress(OSError, ValueError):
                    out.write(f"watchdog: on_stall failed:\n{traceback.format_exc()}")
        if self.exit_status is not None:
            with contextlib.suppress(OSError, ValueError):
                out.flush()
                sys.stdout.flush()
            os._exit(self.exit_status)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._backstop:  # pushed back at every look: it fires only if no look is taken
                faulthandler.dump_traceback_later(self.stall_s, exit=True)
            if not self.check():
                return

    def start(self, backstop: bool = True) -> Watchdog:
        """Look every `every_s` from a daemon thread; with `backstop`, `faulthandler`'s timer too (one per
        process: a second watchdog's, or anyone's, replaces it)."""
        self._backstop = backstop
        if backstop:
            faulthandler.dump_traceback_later(self.stall_s, exit=True)
        self.check()  # the first look: stillness is timed from here
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def _disarm_backstop(self) -> None:
        if self._backstop:
            self._backstop = False
            faulthandler.cancel_dump_traceback_later()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._disarm_backstop()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
