"""How many of a worker process's rooms join at once. Joining a room is the heaviest Python a call does (the
connect, the framework's session, its room I/O and the first subscriptions); a dozen callers who arrive in
the same instant join together and hold the process's interpreter for seconds, and every call already live
in it goes quiet meanwhile. Rooms past the limit wait their turn, a fraction of a second each, while their
callers hear the ringing. Knows threads and asyncio; nothing of LiveKit or the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

POLL_S = 0.05  # how often a waiting room looks for its turn


class JoinGate:
    """At most `limit` rooms of this process joining at a time (0: no limit), across the job threads' own
    event loops. `waited` counts the joins that had to wait their turn."""

    def __init__(self, limit: int) -> None:
        self._sem = threading.BoundedSemaphore(limit) if limit > 0 else None
        self.waited = 0

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Inside: this room's turn to join. A room cancelled while it waits takes no turn."""
        if self._sem is None:
            yield
            return
        if not self._sem.acquire(blocking=False):
            self.waited += 1
            while not self._sem.acquire(blocking=False):  # polled: a cancelled wait holds nothing
                await asyncio.sleep(POLL_S)
        try:
            yield
        finally:
            self._sem.release()


_gate: JoinGate | None = None
_lock = threading.Lock()


def join_gate(limit: int) -> JoinGate:
    """This process's gate (made on first use with `limit`)."""
    global _gate
    with _lock:
        if _gate is None:
            _gate = JoinGate(limit)
        return _gate
