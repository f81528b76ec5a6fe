"""The worker's watch on its engine's process: when it dies, however it died (killed, crashed, its door
stopped), the worker is full at once (no room is offered to it, no job admitted) and the engine is started
again, at the same address and with the same keys, so rooms' processes forked before the death find the new
one; waits between tries grow (1, 2, 4 ... RESTART_MAX_S s). An engine that dies GIVE_UP_AFTER times within
GIVE_UP_WINDOW_S is not tried again: the worker exits with ENGINE_FAILING, for its supervisor (systemd,
Kubernetes) to restart the whole worker. Knows the engine's process and the worker's end of its door;
nothing of LiveKit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.api import EngineClosed
from engine.client.control import EngineControl
from engine.client.process import EngineProcess

log = logging.getLogger("chorus.agent.engine_watch")

RESTART_FIRST_S = 1.0  # the wait before the first restart; doubled for each death in the window
RESTART_MAX_S = 30.0
GIVE_UP_AFTER = 3  # deaths ...
GIVE_UP_WINDOW_S = 300.0  # ... within this long: the worker exits
ENGINE_FAILING = 70  # the worker's exit status then (EX_SOFTWARE)


def exit_worker() -> None:
    """The worker's end when its engine keeps dying: at once, with ENGINE_FAILING (its rooms have lost their
    engine already; their processes and the engine's end with the worker's)."""
    logging.shutdown()
    os._exit(ENGINE_FAILING)


class EngineWatch:
    """`process` (started) and the worker's `control` end of its door, watched from a thread of their own
    (`start`). `up` says whether the engine serves now; `load` is 1.0 whenever it does not. `restarts`
    counts the engine's restarts; `give_up` runs when it has died too often (by default the worker exits)."""

    def __init__(
        self,
        process: EngineProcess,
        control: EngineControl,
        *,
        clock: Callable[[], float] = time.monotonic,
        give_up: Callable[[], None] = exit_worker,
    ) -> None:
        self.process, self.control = process, control
        self.clock, self.give_up = clock, give_up
        self.restarts = 0
        self.deaths: deque[float] = deque()
        self._up = threading.Event()
        self._up.set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chorus-engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    @property
    def up(self) -> bool:
        return self._up.is_set()

    @property
    def load(self) -> float:
        """What the worker tells LiveKit: the engine's load, or 1.0 (full) while it is down or unreachable."""
        return 1.0 if self.down else self.control.load

    @property
    def down(self) -> bool:
        """The engine's process died and is not yet back (or is not started again)."""
        return not (self._up.is_set() and self.process.alive)

    def stop(self) -> None:
        """The worker ends: the engine is stopped, and not started again."""
        self._stopping.set()
        self.control.close()
        self.process.stop()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            proc = self.process.proc
            code = proc.wait() if proc is not None else None
            if self._stopping.is_set():
                return
            self._up.clear()
            self.control.close()
            now = self.clock()
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > GIVE_UP_WINDOW_S:
                self.deaths.popleft()
            n = len(self.deaths)
            log.error(
                "the engine's process ended (status %s): this worker takes no room until it is back "
                "(%d of %d deaths allowed within %.0f s)",
                code,
                n,
                GIVE_UP_AFTER,
                GIVE_UP_WINDOW_S,
            )
            if n >= GIVE_UP_AFTER:
                log.critical(
                    "the engine died %d times within %.0f s: the worker exits with status %d for its "
                    "supervisor to restart it",
                    n,
                    GIVE_UP_WINDOW_S,
                    ENGINE_FAILING,
                )
                self.give_up()
                return
            if self._stopping.wait(min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (n - 1))):
                return
            try:
                self.process.start()
            except EngineClosed as e:
                log.error("the engine did not start again: %s", e)
                continue  # its process has ended: counted as another death on the next pass
            self.restarts += 1
            self._up.set()
            log.info("the engine is back (restart %d): this worker takes rooms again", self.restarts)
