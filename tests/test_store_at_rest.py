"""The booking store's files at rest and across room processes, on SQLite: the database, its -wal and -shm are
the owner's alone (0600, in a folder of 0700) whatever the umask; a conversation deleted leaves no byte of
itself in the database's files; a room's process opens the store without creating or migrating it, and a
store not migrated is refused with a sentence; another process hung inside a write leaves bookings a bounded
`Busy` and new rooms still open; a duplicate key is told as one, at once.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import hotel_support
from agent.fleet import carry
from agent.fleet.carry import ConversationLog
from hotel_support import booking
from tools.errors import AlreadyExists, Busy
from tools.settings import SQLITE_FILE, StoreSettings
from tools.store import StoreError, open_store

pytestmark = pytest.mark.serial  # PostgreSQL, and a process hung inside a write (tests/conftest.py)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def files_of(db: Path) -> dict[str, int]:
    """The mode of the database and of each companion SQLite has made beside it."""
    found = {db.name: mode(db)}
    for suffix in ("-wal", "-shm", "-journal"):
        other = db.with_name(db.name + suffix)
        if other.exists():
            found[other.name] = mode(other)
    return found


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o000], indirect=True, ids=["022", "000"])
def test_the_database_its_wal_and_shm_are_the_owners_alone_whatever_the_umask(umask, tmp_path):
    settings = StoreSettings(data_dir=tmp_path / "data")
    db = settings.sqlite_path
    with hotel_support.seeded_store("sqlite", tmp_path / "data") as store:  # the worker: creates, migrates
        assert (
            hotel_support.hotel(store)
            .call("book_room", booking(), session="s1")["message"]
            .startswith("Booked")
        )
        seen = [files_of(db)]
        with open_store(settings, migrate=False) as room:  # a room's process, writing a conversation
            room.transact(lambda tx: tx.put_conversation("RM_modes", '{"key": "AJ_1"}'), write=True)
            seen.append(files_of(db))
    # the last connection gone, SQLite removed the WAL; a room's process makes it again
    with open_store(settings, migrate=False) as room:
        room.transact(lambda tx: tx.delete_conversation("RM_modes"), write=True)
        seen.append(files_of(db))
    shown = [{name: oct(m) for name, m in files.items()} for files in seen]
    print(f"\numask {umask:03o}: folder {oct(mode(db.parent))}, files {shown}")
    assert mode(db.parent) == 0o700
    for files in seen:
        assert {f"{SQLITE_FILE}-wal", f"{SQLITE_FILE}-shm"} <= set(files)
        assert set(files.values()) == {0o600}, files


def test_an_older_databases_readable_files_and_own_folder_are_tightened(tmp_path):
    folder = tmp_path / "data"
    with hotel_support.seeded_store("sqlite", folder):
        pass
    db = folder / SQLITE_FILE
    os.chmod(folder, 0o755)
    os.chmod(db, 0o644)
    with open_store(StoreSettings(data_dir=folder)) as store:
        store.transact(lambda tx: tx.put_conversation("RM_old", "{}"), write=True)
        assert files_of(db) == dict.fromkeys(files_of(db), 0o600)
    assert mode(folder) == 0o700


async def _kept_and_forgotten(store, sid: str, marker: str, how: str) -> None:
    log = await ConversationLog.open(store, sid, "AJ_marker", resumed=False)
    for i in range(3):  # three versions of the row: each one in the WAL
        log.said(f"My name is {marker} and my code is {i}{i}{i}.")
        await log.flush()
    if how == "ended":
        await log.forget()
    elif how == "over":
        carry.forget_rooms(store, [sid])
    else:  # left behind, then purged
        old = store.now().replace(year=2000)
        store.transact(lambda tx: tx.put_conversation(sid, tx.conversation(sid), at=old), write=True)
        assert carry.purge_stale(store) == 1


@pytest.mark.parametrize("how", ["ended", "over", "purged"])
def test_a_deleted_conversation_leaves_no_byte_of_itself_in_the_files(how, tmp_path):
    marker = f"Zebulon-{uuid.uuid4().hex}"
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        asyncio.run(_kept_and_forgotten(store, "RM_private", marker, how))
        assert store.transact(lambda tx: tx.conversation("RM_private")) is None
        db = store.path  # type: ignore[attr-defined]
        wal = db.with_name(db.name + "-wal")
        found = {p.name: p.read_bytes().count(marker.encode()) for p in (db, wal) if p.exists()}
    print(f"\n{how}: the marker in {found}")
    assert found and not any(found.values()), found


def test_a_rooms_open_neither_creates_nor_migrates_and_says_why_it_refuses(tmp_path):
    settings = StoreSettings(data_dir=tmp_path / "data")
    with pytest.raises(StoreError) as missing:
        open_store(settings, migrate=False)
    assert "cannot be opened" in str(missing.value) and not settings.sqlite_path.exists()

    settings.sqlite_path.parent.mkdir()
    settings.sqlite_path.touch(mode=0o600)  # there, but never migrated
    with pytest.raises(StoreError) as unmigrated:
        open_store(settings, migrate=False)
    assert "is not migrated (schema version 0" in str(unmigrated.value)
    assert "the worker migrates it at start" in str(unmigrated.value)

    with open_store(settings) as worker:  # the worker's start
        version = worker.schema_version()
    with open_store(settings, migrate=False) as room:
        assert room.schema_version() == version


def test_a_rooms_open_of_a_postgresql_schema_not_migrated_is_refused_and_creates_nothing():
    import psycopg

    from tools.store.postgres import PostgresStore

    url, schema = hotel_support.postgres_url(), hotel_support.fresh_schema()
    with pytest.raises(StoreError) as refused:
        PostgresStore(url, schema=schema, pool_size=1, migrate=False)
    assert "is not migrated (schema version 0" in str(refused.value)
    with psycopg.connect(url) as conn:
        made = conn.execute("SELECT COUNT(*) FROM pg_namespace WHERE nspname = %s", [schema]).fetchone()[0]
    assert made == 0
    worker = PostgresStore(url, schema=schema, pool_size=1)  # the worker's start
    try:
        with PostgresStore(url, schema=schema, pool_size=1, migrate=False) as room:
            assert room.schema_version() == worker.schema_version()
    finally:
        worker.drop_schema()
        worker.close()


HOLDER = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO conversations (room_sid, state, updated_at) VALUES ('RM_hung', '{}', '2030')")
    print("holding", flush=True)
    time.sleep(120)  # a room's process hung inside its write, the lock held
    """
)


def test_a_process_hung_inside_a_write_leaves_bookings_a_bounded_busy_and_new_rooms_open(
    tmp_path, monkeypatch
):
    from agent import room_process

    with hotel_support.seeded_store("sqlite", tmp_path / "data") as store:
        db = store.path  # type: ignore[attr-defined]
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "holding"
            monkeypatch.delenv("DATABASE_URL", raising=False)
            monkeypatch.setenv("CHORUS_DATA_DIR", str(db.parent))
            room_process.close_room()
            start = time.monotonic()
            try:
                hotel = room_process.shared_hotel()  # a new room's process opens the store
            except Exception as e:  # noqa: BLE001 (what it raised is the finding)
                pytest.fail(f"a new room's open raised {type(e).__module__}.{type(e).__name__}: {e}")
            opened_s = time.monotonic() - start
            assert hotel.store.transact(lambda tx: tx.hotel()) is not None  # it reads
            with open_store(StoreSettings(data_dir=db.parent)):  # a worker starting again: migrated, goes on
                pass
            deadline_s = 3.0
            hotel.deadline_s = deadline_s
            start = time.monotonic()
            with pytest.raises(Busy) as busy:
                hotel.call("book_room", booking(), session="s1")
            took_s = time.monotonic() - start
        finally:
            holder.kill()
            holder.wait()
            room_process.close_room()
        print(f"\nopened in {opened_s:.2f} s; the booking told busy after {took_s:.2f} s")
        assert opened_s < 2.0
        assert took_s <= deadline_s + 1.0
        assert "try again" in busy.value.message
        assert store.transact(lambda tx: tx.reservations()) == []  # nothing booked, nothing half-made
        assert store.transact(lambda tx: tx.conversation("RM_hung")) is None  # the hung write never landed


EXCLUSIVE = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA locking_mode = EXCLUSIVE")  # readers shut out too, as no room's process does
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("INSERT INTO conversations (room_sid, state, updated_at) VALUES ('RM_hung', '{}', '2030')")
    print("holding", flush=True)
    time.sleep(120)
    """
)


def test_a_rooms_open_shut_out_by_another_process_is_a_bounded_store_error(tmp_path):
    from tools.store.sqlite import SqliteStore

    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        db = store.path  # type: ignore[attr-defined]
    holder = subprocess.Popen([sys.executable, "-c", EXCLUSIVE, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        start = time.monotonic()
        with pytest.raises(StoreError) as refused:
            SqliteStore(db, busy_timeout_s=0.5, migrate=False)
        took_s = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    print(f"\nrefused after {took_s:.2f} s: {refused.value}")
    assert type(refused.value) is StoreError
    assert "stayed locked by another process for 0.5 s" in str(refused.value)
    assert took_s < 3.0


def test_a_duplicate_key_is_told_as_a_duplicate_at_once_not_busy(tmp_path):
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        code = hotel_support.hotel(store).call("book_room", booking(), session="s1")["confirmation_code"]
        (mine,) = store.transact(lambda tx: tx.reservations())
        attempts = []

        def again(tx) -> None:
            attempts.append(1)
            tx.insert_reservation(mine.but(idempotency_key="another"))  # the same code: a bug's duplicate

        with pytest.raises(AlreadyExists) as told:
            store.transact(again, write=True)
        assert len(attempts) == 1
        assert "already exists" in told.value.message and code not in told.value.message
        assert [r.code for r in store.transact(lambda tx: tx.reservations())] == [code]
