"""The worker's care of the booking store: it migrates the store once at start, before any room's process
opens it (a room's process only checks the schema: agent/room_process.py), and purges the conversations that
calls which never ended cleanly left behind (agent/fleet/carry.py), at start and every PURGE_EVERY_S after,
whether or not another call comes. Knows the store's opening and carry's purge; nothing of LiveKit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from agent.fleet.carry import PURGE_EVERY_S, forget_rooms, purge_stale
from tools.store.errors import StoreError

if TYPE_CHECKING:
    from agent.settings import AgentSettings
    from tools.store.base import Store

log = logging.getLogger("chorus.agent.kept")


class Keeper:
    """Migrates the store (`migrate`, until it has succeeded once) and purges stale conversations from
    `store()` (unless `keep`: an operator keeps them), at `start` and then at each `tick` PURGE_EVERY_S
    (`every_s`) of `clock` after the last; `run` ticks on its own. A failure is logged and tried again at the
    next tick: the store down at start delays the purge, never the worker."""

    def __init__(
        self,
        store: Callable[[], Store],
        *,
        migrate: Callable[[], None],
        keep: bool = False,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = PURGE_EVERY_S,
    ) -> None:
        self._store, self._migrate, self.keep = store, migrate, keep
        self._clock, self.every_s = clock, every_s
        self.migrated = False
        self.purged = 0  # conversations purged so far
        self._last: float | None = None

    def start(self) -> None:
        """Migrate, then purge (in a thread: it waits on the database)."""
        self._last = self._clock()
        self._run()

    def due_in(self) -> float:
        """Seconds until the next tick is due (0: now)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.every_s - self._clock())

    def tick(self) -> bool:
        """Purge (and migrate, if that failed so far) when due; whether it was."""
        if self.due_in() > 0:
            return False
        self._last = self._clock()
        self._run()
        return True

    async def run(self, sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        """Tick every `every_s`, until cancelled."""
        while True:
            await sleep(self.due_in())
            await asyncio.to_thread(self.tick)

    def _run(self) -> None:
        try:
            if not self.migrated:
                self._migrate()
                self.migrated = True
            if not self.keep:
                purged = purge_stale(self._store())
                self.purged += purged
                if purged:
                    log.info("purged %d conversations left by calls that did not end cleanly", purged)
        except Exception as e:  # noqa: BLE001 (tried again at the next tick)
            why = e if isinstance(e, StoreError) else type(e).__name__  # our sentences: no caller's data
            what = "purged" if self.migrated else "migrated"
            log.warning("the booking store could not be %s (%s)", what, why)


def start_keeping(settings: AgentSettings) -> Keeper:
    """The worker's keeper of the environment's store, started: the store migrated before any room's process
    opens it, and stale conversations purged (the worker's own store, agent/room_process.py)."""
    from agent.room_process import shared_hotel
    from tools.store import open_store

    def migrate() -> None:
        open_store().close()

    keeper = Keeper(lambda: shared_hotel().store, migrate=migrate, keep=settings.keep_conversations)
    keeper.start()
    return keeper


def forget_conversations(sids: list[str]) -> None:
    """The conversations of calls that ended with no agent in their room (the fleet's watch found them)."""
    from agent.room_process import shared_hotel

    forget_rooms(shared_hotel().store, sids)
