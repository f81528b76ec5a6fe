"""Which of the fleet's workers are gone (agent/fleet/fleet.py): a worker holds a connection of its own to the
cluster's Redis, named after it (agent/fleet/marks.py's `presence_name`), which its host's kernel closes when
its process dies; a worker named by a live mark whose connection has been missing from Redis' client list for
GONE_S is dead, and its rooms are alone without waiting for their marks to expire. Where an ACL forbids
CLIENT LIST, none is found gone: the marks alone tell. A worker's own presence connection is pinged before
its marks: one that does not answer (closed by someone, Redis busy) leaves its rooms marked all the same.
Knows Redis; nothing of LiveKit, the engine or the call.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from agent.fleet import timing
from agent.fleet.marks import _redis_errors, present_workers

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("chorus.agent.fleet")


class Presences:
    """One worker's view of the other workers' presence connections."""

    def __init__(self, redis: Redis, agent_name: str, worker: str) -> None:
        self.redis, self.agent_name, self.worker = redis, agent_name, worker
        self._missing: dict[str, float] = {}  # worker -> when its connection was first found missing
        self._dead: set[str] = set()  # workers found gone (logged once each)
        self._clients = True  # Redis answers CLIENT LIST (an ACL may forbid it: then marks alone tell)
        self._unpinged = False  # this worker's own presence connection did not answer the last ping

    async def ping(self, presence: Redis) -> None:
        """(Re)opens this worker's own presence connection; one that fails is said once while it fails, and
        the worker marks its rooms all the same (its marks, not its connection, keep them)."""
        try:
            await presence.ping()
        except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
            if not self._unpinged:
                log.warning(
                    "the worker's presence connection failed (%s); its rooms are marked still",
                    type(e).__name__,
                )
            self._unpinged = True
            return
        if self._unpinged:
            log.info("the worker's presence connection is back")
        self._unpinged = False

    async def gone(self, workers: set[str], at_once: bool = False) -> set[str]:
        """Of the workers named by live marks, those whose presence connection has been missing from Redis
        for GONE_S (`at_once`: missing now), their process died; none when Redis does not list its clients to
        this worker."""
        workers.discard(self.worker)
        if not workers or not self._clients:
            return set()
        present = await present_workers(self.redis, self.agent_name, workers)
        if present is None:
            self._clients = False
            log.warning(
                "Redis does not list its clients to this worker: a dead worker's rooms wait for marks"
            )
            return set()
        now = time.monotonic()
        gone = set()
        for w in workers:
            if w in present:
                self._missing.pop(w, None)
            elif at_once or now - self._missing.setdefault(w, now) >= timing.GONE_S:
                gone.add(w)
                if w not in self._dead:
                    self._dead.add(w)
                    log.info(
                        "worker %s is gone (its connection left Redis %.1f s ago): its rooms are alone",
                        w,
                        now - self._missing[w] if w in self._missing else 0.0,
                    )
        if len(self._missing) > 1024:  # workers long gone
            self._missing = {w: t for w, t in self._missing.items() if now - t < 3600}
            self._dead &= set(self._missing)
        return gone
