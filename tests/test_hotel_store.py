"""The booking store on SQLite and on a real PostgreSQL server: migrations, bookings, changes, cancellations,
idempotency, rollback of a failed booking, and bookings that survive the process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import date, timedelta
from pathlib import Path

import pytest

import hotel_support
from hotel_support import TODAY, booking, cancelling
from testkit.server import run_python_module
from tools.audit import audit
from tools.errors import Busy, HotelError, InvalidRequest, NotAllowed, NotFound, SoldOut
from tools.store import LATEST_VERSION, SchemaTooNew, Tx

pytestmark = pytest.mark.serial  # PostgreSQL (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=hotel_support.BACKENDS)
def store(request, tmp_path):
    with hotel_support.seeded_store(request.param, tmp_path) as s:
        yield s


@pytest.fixture
def hotel(store):
    return hotel_support.hotel(store)


def count(store, sql: str) -> int:
    return store.transact(lambda tx: tx._rows(sql)[0][0])


def booked(store, room_type: str, first: date, last: date) -> list[int]:
    return [n.booked for n in store.transact(lambda tx: tx.nights([(room_type, first, last)]))]


# --- schema ----------------------------------------------------------------------------------------------


def test_a_new_database_is_migrated_to_the_latest_version_once(store):
    assert store.schema_version() == LATEST_VERSION
    assert store.migrate() == LATEST_VERSION  # again: nothing to apply
    assert count(store, "SELECT COUNT(*) FROM schema_migrations") == LATEST_VERSION


def test_a_database_from_newer_code_is_refused(store):
    store.transact(
        lambda tx: tx._run(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
            [LATEST_VERSION + 1, "from_the_future", store.now()],
        ),
        write=True,
    )
    with pytest.raises(SchemaTooNew):
        store.migrate()


def test_both_dialects_render_the_same_migrations_with_their_own_column_types():
    from tools.store.schema import migrations

    sqlite, postgres = migrations("sqlite"), migrations("postgres")
    assert [(v, name) for v, name, _ in sqlite] == [(v, name) for v, name, _ in postgres]
    assert len(sqlite) == LATEST_VERSION
    assert not any("{" in sql for _, _, sql in sqlite + postgres)  # every type placeholder is rendered
    initial = {"sqlite": " ".join(sqlite[0][2].split()), "postgres": " ".join(postgres[0][2].split())}
    assert "night TEXT NOT NULL" in initial["sqlite"] and "night DATE NOT NULL" in initial["postgres"]
    assert "created_at TEXT NOT NULL" in initial["sqlite"]
    assert "created_at TIMESTAMPTZ NOT NULL" in initial["postgres"]
    assert "total_cents BIGINT NOT NULL" in initial["postgres"]


def test_a_migration_placeholder_without_a_type_is_refused():
    from tools.store import StoreError
    from tools.store.schema import render

    assert render("night {date} NOT NULL", "postgres") == "night DATE NOT NULL"
    with pytest.raises(StoreError, match="placeholder"):
        render("night {day} NOT NULL", "sqlite")


def test_sqlite_runs_in_wal_mode(tmp_path):
    with hotel_support.seeded_store("sqlite", tmp_path, data=None) as s:
        assert s.transact(lambda tx: tx._rows("PRAGMA journal_mode")[0][0]) == "wal"
        assert s.transact(lambda tx: tx._rows("PRAGMA foreign_keys")[0][0]) == 1


def test_seeding_again_keeps_bookings_and_adds_only_missing_nights(store, hotel):
    from tools.seed import seed

    code = hotel.book_room(booking())["confirmation_code"]
    assert seed(store, TODAY, hotel_support.TEST_HOTEL) == 0
    assert (
        seed(store, TODAY + timedelta(days=2), hotel_support.TEST_HOTEL) == 2 * 3
    )  # two new days, three types
    assert (
        hotel.find_reservation({"confirmation_code": code, "last_name": "Lovelace"})["status"] == "confirmed"
    )
    assert audit(store) == []


# --- booking -----------------------------------------------------------------------------------------------


def test_a_booking_writes_one_reservation_and_takes_the_nights(store, hotel):
    result = hotel.book_room(booking(check_in="2030-03-15", check_out="2030-03-17"))  # Friday and Saturday
    assert result["room_type"] == "Deluxe King" and result["nights"] == 2
    assert result["total"] == "$550.80"  # 2 x $240 weekend nights + 14.75 % tax
    r = store.transact(lambda tx: tx.reservation(result["confirmation_code"]))
    assert (r.status, r.guest_name, r.contact, r.room_type) == (
        "confirmed",
        "Ada Lovelace",
        "+442079460958",
        "deluxe_king",
    )
    assert (r.check_in, r.check_out, r.guests) == (date(2030, 3, 15), date(2030, 3, 17), 2)
    assert (r.subtotal_cents, r.tax_cents, r.total_cents) == (48000, 7080, 55080)
    assert booked(store, "deluxe_king", date(2030, 3, 14), date(2030, 3, 18)) == [0, 1, 1, 0]
    assert audit(store) == []


def test_a_name_with_quotes_and_accents_round_trips_exactly(store, hotel):
    code = hotel.book_room(booking(guest_name="Zoë O'Brien-Núñez"))["confirmation_code"]
    assert store.transact(lambda tx: tx.reservation(code)).guest_name == "Zoë O'Brien-Núñez"
    found = hotel.find_reservation({"confirmation_code": code, "last_name": "o'brien nunez"})
    assert found["guest_name"] == "Zoë O'Brien-Núñez"


def test_the_last_room_cannot_be_booked_twice_and_the_answer_offers_another(store, hotel):
    hotel.book_room(booking())
    with pytest.raises(SoldOut) as err:
        hotel.book_room(booking(guest_name="Charles Babbage", check_in="2030-03-13", check_out="2030-03-15"))
    assert err.value.message.startswith(
        "No Deluxe King rooms are left on Wednesday the 13th; a Standard Queen"
    )
    assert count(store, "SELECT COUNT(*) FROM reservations") == 1
    assert audit(store) == []


def test_too_many_guests_for_the_room_names_one_that_fits(hotel):
    with pytest.raises(InvalidRequest, match="sleeps at most 2. For 3 guests, the Family Suite sleeps 4"):
        hotel.book_room(booking(guests=3))
    with pytest.raises(
        InvalidRequest, match="largest room, the Family Suite, sleeps 4; 6 guests need two rooms"
    ):
        hotel.book_room(booking(guests=6, room_type="suite"))


def test_dates_without_inventory_are_not_bookable(hotel):
    # the 90-day horizon allows the check-in; inventory was seeded 120 days ahead
    with pytest.raises(InvalidRequest, match="90 days ahead"):
        hotel.book_room(booking(check_in="2030-07-01", nights=2))


def test_availability_lists_rooms_that_fit_with_totals(store, hotel):
    hotel.book_room(booking())
    result = hotel.check_availability({"check_in": "2030-03-12", "nights": 2, "guests": 2})
    assert [(o["room_type"], o["rooms_left"], o["total"]) for o in result["available"]] == [
        ("Standard Queen", 3, "$229.50"),
        ("Family Suite", 1, "$688.50"),
    ]
    wanted = hotel.check_availability(
        {"check_in": "2030-03-12", "nights": 2, "guests": 2, "room_type": "deluxe"}
    )
    assert wanted["message"].startswith(
        "No Deluxe King rooms are left on Tuesday the 12th; a Standard Queen is"
    )
    family = hotel.check_availability({"check_in": "2030-03-12", "nights": 2, "guests": 4})
    assert [o["room_type"] for o in family["available"]] == ["Family Suite"]


# --- idempotency and atomicity -----------------------------------------------------------------------


def test_a_retried_booking_with_the_same_key_books_once(store, hotel):
    first = hotel.book_room(booking(room_type="standard"), idempotency_key="call-42")
    again = hotel.book_room(booking(room_type="standard"), idempotency_key="call-42")
    assert again["confirmation_code"] == first["confirmation_code"]
    assert (first["already_booked"], again["already_booked"]) == (False, True)
    assert count(store, "SELECT COUNT(*) FROM reservations") == 1
    assert booked(store, "standard_queen", date(2030, 3, 12), date(2030, 3, 14)) == [1, 1]
    other = hotel.book_room(booking(room_type="standard"), idempotency_key="call-43")
    assert other["confirmation_code"] != first["confirmation_code"]
    assert booked(store, "standard_queen", date(2030, 3, 12), date(2030, 3, 14)) == [2, 2]


def test_the_same_booking_asked_twice_in_one_conversation_books_once(store, hotel):
    first = hotel.call("book_room", booking(room_type="standard"), session="call-A")
    again = hotel.call(
        "book_room", booking(room_type="Standard Queen", guest_name="ada  lovelace"), session="call-A"
    )
    other_call = hotel.call("book_room", booking(room_type="standard"), session="call-B")
    assert again["confirmation_code"] == first["confirmation_code"] != other_call["confirmation_code"]
    assert again["message"].startswith("This booking was already made")
    assert count(store, "SELECT COUNT(*) FROM reservations") == 2


def test_concurrent_retries_with_one_key_book_once(store, hotel):
    barrier = threading.Barrier(12)
    codes, errors = [], []

    def attempt():
        barrier.wait()
        try:
            codes.append(
                hotel.book_room(booking(room_type="standard"), idempotency_key="same")["confirmation_code"]
            )
        except Exception as exc:  # noqa: BLE001 (collected and asserted on)
            errors.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(codes)) == 1 and len(codes) == 12
    assert count(store, "SELECT COUNT(*) FROM reservations") == 1
    assert audit(store) == []


def test_an_exception_in_the_middle_of_a_booking_leaves_no_partial_row(store, hotel, monkeypatch):
    def insert_then_fail(self, reservation):
        # the nights are already taken when this runs; the reservation row is never written
        assert self.nights([("deluxe_king", date(2030, 3, 12), date(2030, 3, 14))])[0].booked == 1
        raise RuntimeError("power cut")

    monkeypatch.setattr(Tx, "insert_reservation", insert_then_fail)
    with pytest.raises(RuntimeError, match="power cut"):
        hotel.book_room(booking())
    monkeypatch.undo()
    assert count(store, "SELECT COUNT(*) FROM reservations") == 0
    assert booked(store, "deluxe_king", date(2030, 3, 12), date(2030, 3, 14)) == [0, 0]
    assert audit(store) == []
    assert hotel.book_room(booking())["status"] == "confirmed"  # the room was not lost either


def test_an_exception_in_the_middle_of_a_change_leaves_the_booking_as_it_was(store, hotel, monkeypatch):
    code = hotel.book_room(booking())["confirmation_code"]
    before = store.transact(lambda tx: tx.reservation(code))
    monkeypatch.setattr(
        Tx, "update_reservation", lambda self, r: (_ for _ in ()).throw(RuntimeError("crash"))
    )
    with pytest.raises(RuntimeError):
        hotel.change_or_cancel_reservation(
            {"confirmation_code": code, "last_name": "Lovelace", "action": "change", "room_type": "suite"}
        )
    monkeypatch.undo()
    assert store.transact(lambda tx: tx.reservation(code)) == before
    assert booked(store, "family_suite", date(2030, 3, 12), date(2030, 3, 14)) == [0, 0]
    assert audit(store) == []


# --- lookup, change, cancel --------------------------------------------------------------------------


def test_lookup_needs_the_code_and_the_surname(hotel):
    code = hotel.book_room(booking())["confirmation_code"]
    spaced = f"{code[:4].lower()} - {code[4:]}"
    assert (
        hotel.find_reservation({"confirmation_code": spaced, "last_name": "LOVELACE"})["confirmation_code"]
        == code
    )
    for wrong in (
        {"confirmation_code": code, "last_name": "Babbage"},
        {"confirmation_code": "AAAAAAAA", "last_name": "Lovelace"},
    ):
        with pytest.raises(NotFound) as err:
            hotel.find_reservation(wrong)
        assert "confirmation code and last name" in err.value.message  # never says which one was wrong


def test_changing_dates_and_room_moves_the_inventory_and_reprices(store, hotel):
    code = hotel.book_room(booking(room_type="standard"))["confirmation_code"]
    changed = hotel.change_or_cancel_reservation(
        {
            "confirmation_code": code,
            "last_name": "Lovelace",
            "action": "change",
            "check_in": "2030-03-20",
            "room_type": "deluxe",
        }
    )
    assert (changed["check_in"], changed["check_out"], changed["room_type"]) == (
        "2030-03-20",
        "2030-03-22",
        "Deluxe King",
    )
    assert changed["total"] == "$459" and "more than before" in changed["message"]
    assert booked(store, "standard_queen", date(2030, 3, 12), date(2030, 3, 14)) == [0, 0]
    assert booked(store, "deluxe_king", date(2030, 3, 20), date(2030, 3, 22)) == [1, 1]
    shorter = hotel.change_or_cancel_reservation(
        {"confirmation_code": code, "last_name": "Lovelace", "action": "change", "nights": 1}
    )
    assert shorter["check_out"] == "2030-03-21" and "less than before" in shorter["message"]
    assert booked(store, "deluxe_king", date(2030, 3, 20), date(2030, 3, 22)) == [1, 0]
    assert audit(store) == []


def test_a_change_into_a_full_night_is_refused_and_changes_nothing(store, hotel):
    hotel.book_room(booking(guest_name="Charles Babbage", check_in="2030-03-20", nights=1))
    code = hotel.book_room(booking())["confirmation_code"]
    before = store.transact(lambda tx: tx.reservation(code))
    with pytest.raises(SoldOut, match="left on Wednesday the 20th.*The reservation is unchanged"):
        hotel.change_or_cancel_reservation(
            {"confirmation_code": code, "last_name": "Lovelace", "action": "change", "check_in": "2030-03-19"}
        )
    assert store.transact(lambda tx: tx.reservation(code)) == before
    assert audit(store) == []


def test_a_change_can_move_within_its_own_nights(store, hotel):
    # the only deluxe room: shifting the stay by one night must count the nights it already holds
    code = hotel.book_room(booking())["confirmation_code"]
    moved = hotel.change_or_cancel_reservation(
        {"confirmation_code": code, "last_name": "Lovelace", "action": "change", "check_in": "2030-03-13"}
    )
    assert (moved["check_in"], moved["check_out"]) == ("2030-03-13", "2030-03-15")
    assert booked(store, "deluxe_king", date(2030, 3, 12), date(2030, 3, 16)) == [0, 1, 1, 0]


def test_cancelling_late_quotes_the_fee_first_and_charges_it_only_when_accepted(store, hotel):
    code = hotel.book_room(booking(check_in="2030-03-05", nights=2))["confirmation_code"]  # tomorrow
    args = {"confirmation_code": code, "last_name": "Lovelace", "action": "cancel"}
    quote = hotel.change_or_cancel_reservation(args)
    assert quote["status"] == "fee_required" and quote["cancellation_fee"] == "$229.50"
    assert store.transact(lambda tx: tx.reservation(code)).status == "confirmed"
    done = hotel.change_or_cancel_reservation({**args, "accept_fee": True})
    assert done["status"] == "cancelled" and "$229.50" in done["message"]
    r = store.transact(lambda tx: tx.reservation(code))
    assert (r.status, r.cancellation_fee_cents, r.idempotency_key) == ("cancelled", 22950, None)
    assert booked(store, "deluxe_king", date(2030, 3, 5), date(2030, 3, 7)) == [0, 0]
    with pytest.raises(NotAllowed, match="already cancelled"):
        hotel.change_or_cancel_reservation(args)
    assert audit(store) == []


def test_cancelling_early_is_free_and_the_same_stay_can_be_booked_again(store, hotel):
    first = hotel.call("book_room", booking(), session="s")
    cancelled = hotel.change_or_cancel_reservation(
        {"confirmation_code": first["confirmation_code"], "last_name": "Lovelace", "action": "cancel"}
    )
    assert cancelled["status"] == "cancelled" and "no charge" in cancelled["message"]
    again = hotel.call("book_room", booking(), session="s")
    assert again["already_booked"] is False and again["confirmation_code"] != first["confirmation_code"]
    assert audit(store) == []


def test_a_stay_that_has_started_is_left_to_the_front_desk(store):
    hotel = hotel_support.hotel(store)
    code = hotel.book_room(booking(check_in="2030-03-05", nights=3))["confirmation_code"]
    later = hotel_support.hotel(store, TODAY + timedelta(days=2))
    with pytest.raises(NotAllowed, match="already started"):
        later.change_or_cancel_reservation(
            {"confirmation_code": code, "last_name": "Lovelace", "action": "cancel"}
        )


def test_hotel_information_comes_from_the_faq_and_the_policy(hotel):
    assert "Breakfast is served" in hotel.hotel_info({"topic": "breakfast hours"})["answer"]
    assert "valet" in hotel.hotel_info({"topic": "Where can I park my car?"})["answer"]
    assert (
        hotel.hotel_info({"topic": "check-out time"})["answer"]
        == "Check-in is from 3 PM and check-out is until 11 AM."
    )
    unknown = hotel.hotel_info({"topic": "helicopter landing"})
    assert unknown["answer"] is None and "parking" in unknown["message"]


# --- many operations, one consistent database ----------------------------------------------------------


def test_random_operations_keep_the_inventory_equal_to_the_reservations(store, hotel):
    rng = random.Random(7)
    codes: list[str] = []
    outcomes = {"ok": 0, "refused": 0}
    for i in range(150):
        start = TODAY + timedelta(days=rng.randrange(1, 20))
        op = rng.random()
        try:
            if op < 0.55 or not codes:
                args = booking(
                    guest_name=f"{chr(65 + i % 26)}. Lovelace",
                    check_in=start.isoformat(),
                    nights=rng.randrange(1, 4),
                    room_type=rng.choice(["standard", "deluxe", "suite"]),
                )
                codes.append(hotel.book_room(args)["confirmation_code"])
            elif op < 0.8:
                hotel.change_or_cancel_reservation(
                    {
                        "confirmation_code": rng.choice(codes),
                        "last_name": "x" if rng.random() < 0.1 else "Lovelace",
                        "action": "change",
                        "check_in": start.isoformat(),
                        "room_type": rng.choice(["standard", "deluxe", "suite"]),
                    }
                )
            else:
                hotel.change_or_cancel_reservation(cancelling(rng.choice(codes)))
            outcomes["ok"] += 1
        except HotelError:
            outcomes["refused"] += 1
    assert outcomes["ok"] > 40 and outcomes["refused"] > 10, outcomes  # the run exercised both paths
    assert audit(store) == []


# --- restarts ----------------------------------------------------------------------------------------------

_BOOK_THEN_HANG = textwrap.dedent(
    """
    import sys, time
    from datetime import date
    from tools.hotel import Hotel
    from tools.store import open_store
    hotel = Hotel(open_store(), today=lambda: date(2030, 3, 4))
    result = hotel.book_room({"guest_name": "Grace Hopper", "contact": "grace@example.com",
                              "check_in": "2030-03-12", "nights": 2, "guests": 1, "room_type": "suite"})
    print(result["confirmation_code"], flush=True)
    time.sleep(600)  # killed here, without closing anything
    """
)


def test_bookings_survive_the_process_that_made_them(store):
    env = hotel_support.store_env(store)
    child = subprocess.Popen(
        [sys.executable, "-c", _BOOK_THEN_HANG], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        code = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert len(code) == 8, "the child did not book"
    listed = run_python_module("tools", "bookings", "--json", cwd=REPO, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["code"], r["guest_name"], r["status"], r["check_in"]) for r in rows] == [
        (code, "Grace Hopper", "confirmed", "2030-03-12")
    ]
    assert "idempotency_key" not in rows[0]
    audited = run_python_module("tools", "audit", cwd=REPO, env=env, timeout=60)
    assert audited.returncode == 0, audited.stdout + audited.stderr


def test_seed_command_creates_the_default_hotel(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CHORUS_DB_SCHEMA")}
    env["CHORUS_DATA_DIR"] = str(tmp_path / "data")
    run = run_python_module("tools", "seed", "--today", "2030-03-04", cwd=REPO, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "The Larkspur Hotel" in run.stdout
    from tools.settings import StoreSettings
    from tools.store import open_store

    with open_store(StoreSettings(data_dir=tmp_path / "data")) as s:
        rooms = s.transact(lambda tx: tx.room_types())
        assert [r.code for r in rooms] == ["standard_queen", "deluxe_king", "family_suite"]
        assert len(s.transact(lambda tx: tx.faq())) >= 5
        nights = s.transact(lambda tx: tx.nights([(None, date(2030, 3, 4), date(2031, 3, 4))]))
        assert len(nights) == 365 * 3 and all(
            n.booked == 0 and n.total > 0 and n.rate_cents > 0 for n in nights
        )


# --- the connection pool ---------------------------------------------------------------------------------


@contextmanager
def small_pool(backend: str, tmp_path: Path, *, size: int, wait_s: float):
    """A seeded store with `size` connections, whose callers wait at most `wait_s` for one."""
    from tools.seed import seed

    if backend == "sqlite":
        from tools.store.sqlite import SqliteStore

        store = SqliteStore(tmp_path / "hotel.sqlite3", pool_size=size, wait_s=wait_s)
    else:
        from tools.store.postgres import PostgresStore

        url, schema = hotel_support.postgres_url(), hotel_support.fresh_schema()
        store = PostgresStore(url, schema=schema, pool_size=size, wait_s=wait_s)
    try:
        seed(store, TODAY, hotel_support.TEST_HOTEL)
        yield store
    finally:
        if backend == "postgres":
            store.drop_schema()
        store.close()


@pytest.mark.parametrize("backend", hotel_support.BACKENDS)
def test_eight_bookings_on_a_pool_of_two_wait_their_turn_and_all_succeed(backend, tmp_path):
    with small_pool(backend, tmp_path, size=2, wait_s=30.0) as store:
        hotel = hotel_support.hotel(store)
        stays = [
            (TODAY + timedelta(days=6 + 3 * i)).isoformat() for i in range(8)
        ]  # the deluxe room, 8 times
        barrier = threading.Barrier(len(stays))

        def book(check_in: str) -> str:
            barrier.wait()
            return hotel.book_room(booking(check_in=check_in, nights=2))["confirmation_code"]

        with ThreadPoolExecutor(len(stays)) as pool:
            codes = list(pool.map(book, stays))
        rows = store.transact(lambda tx: tx.reservations())
        assert sorted(r.code for r in rows) == sorted(codes) and len(set(codes)) == 8
        assert sorted(r.check_in.isoformat() for r in rows) == stays
        assert audit(store) == []


@pytest.mark.parametrize("backend", hotel_support.BACKENDS)
def test_a_booking_that_finds_every_connection_held_is_told_busy_after_the_wait(backend, tmp_path):
    wait_s = 0.5
    with small_pool(backend, tmp_path, size=2, wait_s=wait_s) as store:
        hotel = hotel_support.hotel(store)
        entered, release = threading.Semaphore(0), threading.Event()

        def hold(tx: Tx) -> None:
            entered.release()
            release.wait(60)

        with ThreadPoolExecutor(3) as pool:
            holders = [pool.submit(store.transact, hold) for _ in range(2)]
            try:
                assert entered.acquire(timeout=30) and entered.acquire(timeout=30), "the pool was not held"
                t0 = time.monotonic()
                refused = pool.submit(hotel.book_room, booking()).exception(timeout=30)
                waited = time.monotonic() - t0
            finally:
                release.set()
            for holder in holders:
                holder.result(timeout=30)
        print(f"told busy after {waited:.2f} s")
        assert isinstance(refused, Busy) and refused.message == Busy().message
        assert refused.message == "The reservation system is busy; please try again in a moment."
        assert wait_s * 0.9 <= waited < wait_s + 10  # it waited, then answered instead of hanging
        assert count(store, "SELECT COUNT(*) FROM reservations") == 0
        hotel.book_room(booking())  # the connections are back: the same booking now goes through
        assert count(store, "SELECT COUNT(*) FROM reservations") == 1
        assert audit(store) == []
