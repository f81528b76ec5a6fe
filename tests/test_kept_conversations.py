"""The worker's keeper of the booking store (agent/fleet/kept.py): at the worker's start the store is migrated
before any room opens it and the conversations left by calls that never ended cleanly are purged, and then
again every PURGE_EVERY_S on the keeper's clock, with no call coming. The clock and the sleep are injected:
nothing here waits on the wall clock.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace

import pytest

import hotel_support
from agent.fleet import carry
from agent.fleet.kept import Keeper, start_keeping
from tools.settings import StoreSettings
from tools.store import StoreError, open_store


def stale(store, sid: str) -> None:
    """A conversation last written longer than KEEP_S ago: its call ended without deleting it."""
    old = store.now() - timedelta(seconds=carry.KEEP_S + 60)
    store.transact(lambda tx: tx.put_conversation(sid, '{"key": "AJ_x"}', at=old), write=True)


def kept(store) -> list[str]:
    return [
        r[0] for r in store.transact(lambda tx: tx._rows("SELECT room_sid FROM conversations ORDER BY 1"))
    ]


@pytest.mark.parametrize("keep", [False, True])
def test_the_workers_start_migrates_the_store_and_purges_what_calls_left(keep, tmp_path, monkeypatch):
    from agent import room_process

    folder = tmp_path / "data"
    with hotel_support.seeded_store("sqlite", folder) as store:
        stale(store, "RM_left")
        store.transact(lambda tx: tx.put_conversation("RM_live", '{"key": "AJ_y"}'), write=True)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("CHORUS_DATA_DIR", str(folder))
    room_process.close_room()
    try:
        keeper = start_keeping(SimpleNamespace(keep_conversations=keep))  # type: ignore[arg-type]
    finally:
        room_process.close_room()
    with open_store(StoreSettings(data_dir=folder), migrate=False) as store:
        left = kept(store)
    assert keeper.migrated
    assert left == (["RM_left", "RM_live"] if keep else ["RM_live"])
    assert keeper.purged == (0 if keep else 1)


def test_a_new_database_is_migrated_at_the_workers_start_before_a_room_opens_it(tmp_path, monkeypatch):
    from agent import room_process

    folder = tmp_path / "fresh"
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("CHORUS_DATA_DIR", str(folder))
    room_process.close_room()
    with pytest.raises(StoreError):  # a room before the worker: refused, nothing created
        room_process.shared_hotel()
    assert not (folder / "hotel.sqlite3").exists()
    try:
        keeper = start_keeping(SimpleNamespace(keep_conversations=False))  # type: ignore[arg-type]
        version = room_process.shared_hotel().store.schema_version()  # a room after it
    finally:
        room_process.close_room()
    assert keeper.migrated and version >= 1


def test_the_timer_purges_every_period_on_its_clock_with_no_call_coming(tmp_path):
    now = [1000.0]
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        keeper = Keeper(lambda: store, migrate=lambda: None, clock=lambda: now[0], every_s=300.0)
        stale(store, "RM_1")
        keeper.start()  # the worker starts
        seen = [kept(store)]
        stale(store, "RM_2")
        now[0] += 299.0
        assert not keeper.tick()  # not yet due
        seen.append(kept(store))
        now[0] += 1.0
        assert keeper.tick()
        seen.append(kept(store))

        slept: list[float] = []

        async def sleep(seconds: float) -> None:  # the keeper's own loop, on the injected clock
            if len(slept) == 3:
                raise asyncio.CancelledError
            slept.append(seconds)
            now[0] += seconds
            stale(store, f"RM_run{len(slept)}")

        with pytest.raises(asyncio.CancelledError):
            asyncio.run(keeper.run(sleep))
        seen.append(kept(store))
    assert seen == [[], ["RM_2"], [], []]
    assert slept == [300.0, 300.0, 300.0]
    assert keeper.purged == 5


def test_a_store_down_at_start_is_migrated_and_purged_at_a_later_tick(tmp_path):
    now, tries = [0.0], []

    def migrate() -> None:
        tries.append(now[0])
        if len(tries) == 1:
            raise StoreError("the booking database cannot be opened")

    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        stale(store, "RM_1")
        keeper = Keeper(lambda: store, migrate=migrate, clock=lambda: now[0], every_s=60.0)
        keeper.start()
        before = (keeper.migrated, kept(store))
        now[0] = 60.0
        keeper.tick()
        after = (keeper.migrated, kept(store))
    assert before == (False, ["RM_1"])  # not purged while not migrated
    assert after == (True, []) and tries == [0.0, 60.0]
