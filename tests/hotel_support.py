"""Test support for the hotel: a freshly seeded store on SQLite or PostgreSQL, and valid tool arguments.

A plain module beside the tests (pytest puts tests/ on sys.path), not part of the shipped `tools` package.

Every store lives in its own place (a temporary SQLite file, or a PostgreSQL schema with a random
name that is dropped afterwards), so tests never see each other's rows. The PostgreSQL server comes
from `CHORUS_TEST_DATABASE_URL` (`.ci/run` starts one); without it those tests skip, except under
`CI=true`, where a missing server is a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import date
from pathlib import Path

import pytest

from tools.hotel import Hotel
from tools.seed import DEFAULT_HOTEL, HotelSeed, RoomSeed
from tools.settings import SQLITE_FILE
from tools.store import RoomType, Store
from tools.store.sqlite import SqliteStore

BACKENDS = ("sqlite", "postgres")
TODAY = date(2030, 3, 4)  # a Monday; the tests' "today"

# A small hotel: three standard rooms, the one and only deluxe room, one suite. 90 days ahead.
TEST_HOTEL = HotelSeed(
    policy=replace(DEFAULT_HOTEL.policy, booking_horizon_days=90),
    rooms=(
        RoomSeed(RoomType("standard_queen", "Standard Queen", "one queen bed.", 2, 1), 3, 10000, 12000),
        RoomSeed(RoomType("deluxe_king", "Deluxe King", "one king bed.", 2, 2), 1, 20000, 24000),
        RoomSeed(
            RoomType("family_suite", "Family Suite", "a king bed and two twins.", 4, 3), 1, 30000, 36000
        ),
    ),
    faq=DEFAULT_HOTEL.faq,
)


def postgres_url() -> str:
    """The test server's URL, or skip (fail under CI=true) when there is none."""
    url = os.environ.get("CHORUS_TEST_DATABASE_URL", "").strip()
    if not url:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but CHORUS_TEST_DATABASE_URL is unset: .ci/run must start PostgreSQL")
        pytest.skip("CHORUS_TEST_DATABASE_URL is unset (source scripts/postgres.sh; start_postgres)")
    return url


def fresh_schema() -> str:
    return f"test_{uuid.uuid4().hex[:16]}"


@contextmanager
def seeded_store(
    backend: str,
    tmp_path: Path,
    *,
    pool_size: int = 8,
    data: HotelSeed | None = TEST_HOTEL,
    today: date = TODAY,
) -> Iterator[Store]:
    """A migrated store of `backend`, seeded with `data` (None: empty), closed and removed afterwards."""
    from tools.seed import seed

    store: Store
    if backend == "sqlite":
        store = SqliteStore(tmp_path / SQLITE_FILE, pool_size=pool_size)
    elif backend == "postgres":
        from tools.store.postgres import PostgresStore

        store = PostgresStore(postgres_url(), schema=fresh_schema(), pool_size=pool_size)
    else:
        raise ValueError(backend)
    try:
        if data is not None:
            seed(store, today, data)
        yield store
    finally:
        if backend == "postgres":
            store.drop_schema()  # type: ignore[attr-defined]
        store.close()


def store_env(store: Store) -> dict[str, str]:
    """Environment variables that point `python -m tools` (or `open_store()`) at `store`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CHORUS_DATA_DIR", "CHORUS_DB_SCHEMA")
    }
    if isinstance(store, SqliteStore):
        env["CHORUS_DATA_DIR"] = str(store.path.parent)
        if store.path.name != SQLITE_FILE:
            raise ValueError(f"open_store() reads <CHORUS_DATA_DIR>/{SQLITE_FILE}")
    else:
        env["DATABASE_URL"] = store.url  # type: ignore[attr-defined]
        env["CHORUS_DB_SCHEMA"] = store.schema  # type: ignore[attr-defined]
    return env


def hotel(store: Store, today: date = TODAY) -> Hotel:
    return Hotel(store, today=lambda: today)


def booking(**overrides: object) -> dict[str, object]:
    """Valid book_room arguments for the deluxe room, two nights from the 12th (`nights` replaces the
    check-out date)."""
    args: dict[str, object] = {
        "guest_name": "Ada Lovelace",
        "contact": "+44 20 7946 0958",
        "check_in": "2030-03-12",
        "check_out": "2030-03-14",
        "guests": 2,
        "room_type": "deluxe",
    }
    if "nights" in overrides and "check_out" not in overrides:
        del args["check_out"]
    args.update(overrides)
    return args


def cancelling(code: str, last_name: str = "Lovelace", **overrides: object) -> dict[str, object]:
    """change_or_cancel_reservation arguments that cancel `code`, the fee accepted."""
    return {
        "confirmation_code": code,
        "last_name": last_name,
        "action": "cancel",
        "accept_fee": True,
        **overrides,
    }
