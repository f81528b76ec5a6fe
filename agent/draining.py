"""The process's drain (SIGTERM, or `AgentServer.drain`): when it began and when the framework will cut the
jobs off, read from any thread. The worker's process begins it (agent/fleet/drain.py `DrainingServer`), a
room's process when its engine says the worker drains (agent/room_process.py); a call's goodbye waits on it
(agent/fleet/drain.py `goodbye_on_drain`). Knows nothing else, so both the room's process and the fleet may
import it.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("chorus.agent.drain")


class Drain:
    """The process's drain: when it began and when the framework will cut the jobs off (read from any job's
    thread)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.deadline = float("inf")  # time.monotonic()

    def begin(self, timeout_s: float) -> None:
        if not self.started.is_set():
            self.deadline = time.monotonic() + timeout_s
            self.started.set()
            log.info("draining: calls in progress have %.0f s", timeout_s)


DRAIN = Drain()
