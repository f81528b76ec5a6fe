"""What each PostgreSQL error means for a transaction, on a live connection to a real server: a unique key a
concurrent writer took first, a serialization failure and a deadlock, each provoked with a second connection,
are retried and the retry commits (the rows are read back); a statement timeout answers `Busy` at once; a bad
cast is a StoreError that names its SQLSTATE and never the value. Every SQLSTATE class ends in the store's
own error and the caller's answer. A seed rate past the INTEGER column is refused whole, with a sentence
saying so, on SQLite and PostgreSQL alike. Without a server the PostgreSQL tests skip (CI starts one).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import astuple, fields, replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

import hotel_support
from hotel_support import BACKENDS, TEST_HOTEL, TODAY
from tools.errors import AlreadyExists, Busy
from tools.seed import seed
from tools.store import Reservation, Store, StoreError
from tools.store.statements import INTEGER_MAX
from wait_support import wait_until

pytestmark = pytest.mark.serial  # PostgreSQL (tests/conftest.py)

ROOM = "deluxe_king"  # one room of its kind in TEST_HOTEL
NIGHT = TODAY + timedelta(days=8)
OTHER_APP = "chorus-test-other"  # the application_name of the test's second connection


@pytest.fixture
def pg(tmp_path) -> Iterator[Store]:
    with hotel_support.seeded_store("postgres", tmp_path, pool_size=2) as store:
        yield store


def other_connection(store: Store) -> psycopg.Connection:
    """A second client of the store's database (not one of its pooled connections), in its schema."""
    conn = psycopg.connect(store.url, autocommit=True, application_name=OTHER_APP)  # type: ignore[attr-defined]
    conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(store.schema)))  # type: ignore[attr-defined]
    return conn


def inventory(store: Store, first=NIGHT, nights: int = 2) -> list[tuple[int, int]]:
    """(booked, rate_cents) of ROOM on `nights` nights from `first`, as committed."""
    rows = store.transact(lambda tx: tx.nights([(ROOM, first, first + timedelta(days=nights))]))
    return [(n.booked, n.rate_cents) for n in rows]


def reservation(code: str, key: str, guest: str) -> Reservation:
    now = datetime(2030, 3, 4, 12, tzinfo=UTC)
    return Reservation(
        code, key, "confirmed", guest, "+44 20 7946 0958", ROOM, NIGHT, NIGHT + timedelta(days=1), 2,
        20000, 2950, 22950, 0, now, now,
    )  # fmt: skip


def test_a_key_a_concurrent_writer_took_first_is_a_conflict_and_the_retry_finds_its_booking(pg):
    key, seen, attempts = "request-1", [], []

    def book(tx) -> str:
        attempts.append(1)
        existing = tx.reservation_by_key(key)
        if existing is not None:
            return existing.code
        if len(attempts) == 1:  # another client books with the same key between the read and the insert
            theirs = reservation("THEIRS22", key, "Grace Hopper")
            columns = ", ".join(f.name for f in fields(Reservation))
            values = ", ".join(["%s"] * len(fields(Reservation)))
            with closing(other_connection(pg)) as other:
                other.execute(f"INSERT INTO reservations ({columns}) VALUES ({values})", astuple(theirs))
        try:
            tx.insert_reservation(reservation("MINE2222", key, "Ada Lovelace"))
        except psycopg.Error as exc:
            seen.append(exc)
            raise
        return "MINE2222"

    assert pg.transact(book, write=True) == "THEIRS22"
    assert [e.sqlstate for e in seen] == ["23505"]  # unique_violation, on the store's own connection
    assert len(attempts) == 2
    assert [(r.code, r.guest_name) for r in pg.transact(lambda tx: tx.reservations())] == [
        ("THEIRS22", "Grace Hopper")
    ]
    assert pg.stats()["conflict"] == 1 and pg.stats()["retried"] == 1


def test_a_key_that_exists_before_the_transaction_is_a_duplicate_told_so_after_one_retry(pg):
    """Not a race: the key was taken before this transaction began, so the retry, which reads that commit,
    inserts against it again. The caller is told it exists (not "busy, try again"), and nothing is written."""
    columns = ", ".join(f.name for f in fields(Reservation))
    values = ", ".join(["%s"] * len(fields(Reservation)))
    with closing(other_connection(pg)) as other:
        other.execute(
            f"INSERT INTO reservations ({columns}) VALUES ({values})",
            astuple(reservation("SAME2222", "k1", "Grace Hopper")),
        )
    seen, attempts = [], []

    def book(tx) -> None:
        attempts.append(1)
        try:
            tx.insert_reservation(reservation("SAME2222", "k2", "Ada Lovelace"))  # a code already given
        except psycopg.Error as exc:
            seen.append(exc)
            raise

    with pytest.raises(AlreadyExists) as told:
        pg.transact(book, write=True)
    assert told.value.message.startswith("That booking already exists")
    assert "SAME2222" not in told.value.message and "Ada" not in told.value.message
    assert [e.sqlstate for e in seen] == ["23505", "23505"]  # once, and once again on the retry
    assert len(attempts) == 2
    assert [(r.code, r.guest_name) for r in pg.transact(lambda tx: tx.reservations())] == [
        ("SAME2222", "Grace Hopper")
    ]
    assert pg.stats()["conflict"] == 2 and pg.stats()["retried"] == 1


@contextmanager
def repeatable_read_store() -> Iterator[Store]:
    """A seeded store whose login role runs every transaction REPEATABLE READ by default (as a server
    configured so would), so its writers can fail to serialize. The role is dropped afterwards."""
    from tools.store.postgres import PostgresStore

    url = hotel_support.postgres_url()
    name = hotel_support.fresh_schema()
    role = sql.Identifier(name)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(role))
        admin.execute(
            sql.SQL("ALTER ROLE {} SET default_transaction_isolation = 'repeatable read'").format(role)
        )
    try:
        store = PostgresStore(make_conninfo(url, user=name), schema=hotel_support.fresh_schema())
        try:
            seed(store, TODAY, TEST_HOTEL)
            yield store
        finally:
            store.drop_schema()
            store.close()
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(role))


def test_a_serialization_failure_is_retried_and_the_retry_commits():
    with repeatable_read_store() as store:
        isolation = store.transact(lambda tx: tx._rows("SHOW transaction_isolation")[0][0], write=True)
        assert isolation == "repeatable read"
        (before,) = inventory(store, nights=1)
        seen, attempts = [], []

        def take(tx) -> int:
            attempts.append(1)
            (night,) = tx.nights([(ROOM, NIGHT, NIGHT + timedelta(days=1))])  # this snapshot's row
            if len(attempts) == 1:  # another client changes the row after the snapshot, and commits
                with closing(other_connection(store)) as other:
                    other.execute(
                        "UPDATE inventory SET rate_cents = rate_cents + 1 "
                        "WHERE room_type = %s AND night = %s",
                        [ROOM, NIGHT],
                    )
            try:
                tx.add_booked(ROOM, NIGHT, NIGHT + timedelta(days=1), 1)
            except psycopg.Error as exc:
                seen.append(exc)
                raise
            return night.rate_cents

        assert store.transact(take, write=True) == before[1] + 1  # the retry read the other's commit
        assert [e.sqlstate for e in seen] == ["40001"]  # serialization_failure
        assert len(attempts) == 2
        assert inventory(store, nights=1) == [(before[0] + 1, before[1] + 1)]  # both changes are there
        assert store.stats()["transient"] == 1 and store.stats()["retried"] == 1


def test_a_deadlock_is_retried_and_the_retry_commits(pg):
    first, second = NIGHT, NIGHT + timedelta(days=1)
    before = inventory(pg)
    other = other_connection(pg)
    # the other client's deadlock check waits longer than the store's (1 s), so the store's backend finds
    # the deadlock and its transaction is the one ended
    other.execute("SET deadlock_timeout = '60s'")
    other.execute("BEGIN")
    other.execute("SELECT 1 FROM inventory WHERE room_type = %s AND night = %s FOR UPDATE", [ROOM, second])
    waiting = other_connection(pg)
    done = threading.Event()

    def other_takes_the_first_night() -> None:
        other.execute("SELECT 1 FROM inventory WHERE room_type = %s AND night = %s FOR UPDATE", [ROOM, first])
        other.execute(
            "UPDATE inventory SET rate_cents = rate_cents + 1 WHERE room_type = %s AND night IN (%s, %s)",
            [ROOM, first, second],
        )
        other.execute("COMMIT")
        done.set()

    def other_waits() -> bool:
        rows = waiting.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
            [OTHER_APP],
        ).fetchone()
        return bool(rows and rows[0])

    seen, attempts = [], []
    thread = threading.Thread(target=other_takes_the_first_night, daemon=True)

    def take_both(tx) -> int:
        attempts.append(1)
        tx.nights([(ROOM, first, first + timedelta(days=1))], lock=True)
        if len(attempts) == 1:  # the other client holds the second night and now waits for the first
            thread.start()
            wait_until(other_waits, "the other client waiting for the first night's lock", timeout=30)
        try:
            tx.nights([(ROOM, second, second + timedelta(days=1))], lock=True)
        except psycopg.Error as exc:
            seen.append(exc)
            raise
        tx.add_booked(ROOM, first, second + timedelta(days=1), 1)
        return len(attempts)

    try:
        assert pg.transact(take_both, write=True) == 2
        thread.join(30)
        assert done.is_set()
    finally:
        other.close()
        waiting.close()
    assert [e.sqlstate for e in seen] == ["40P01"]  # deadlock_detected
    assert inventory(pg) == [(b + 1, rate + 1) for b, rate in before]  # the other's change and the store's
    assert pg.stats()["transient"] == 1 and pg.stats()["retried"] == 1


def test_a_statement_timeout_answers_busy_at_once_and_keeps_the_connection(pg):
    attempts = []

    def slow(tx) -> None:
        attempts.append(1)
        tx._run("SET LOCAL statement_timeout = '100ms'")
        tx._run("SELECT pg_sleep(30)")

    with pytest.raises(Busy) as raised:
        pg.transact(slow)
    assert isinstance(raised.value.__cause__, errors.QueryCanceled)  # 57014, from the server
    assert raised.value.message == Busy().message  # the caller hears "busy, try again in a moment"
    assert len(attempts) == 1  # not retried
    assert pg.stats()["unavailable"] == 1 and pg.stats()["retried"] == 0
    assert pg.transact(lambda tx: tx._rows("SELECT 1")[0][0]) == 1
    assert pg.stats()["lost"] == 0  # the connection was kept, not replaced


def test_a_bad_cast_is_a_store_error_naming_its_sqlstate_and_not_the_value(pg):
    attempts = []

    def bad_cast(tx) -> list:
        attempts.append(1)
        return tx._rows("SELECT night FROM inventory WHERE total = ?::integer", ["Lovelace"])

    with pytest.raises(StoreError) as raised:
        pg.transact(bad_cast)
    assert type(raised.value) is StoreError  # neither retried nor told busy: a bug
    assert isinstance(raised.value.__cause__, errors.InvalidTextRepresentation)
    message = str(raised.value)
    assert "cannot hold" in message and "SQLSTATE 22P02" in message
    assert "Lovelace" not in message  # the server's text quotes the value; the store's never does
    assert len(attempts) == 1
    assert pg.stats()["refused"] == 1 and pg.stats()["retried"] == 0
    assert pg.transact(lambda tx: tx._rows("SELECT 1")[0][0]) == 1


# What an error of each SQLSTATE class ends as, raised inside a transaction on a live connection with two
# attempts allowed: what the call raises, after how many attempts, and what the store counts them as.
RETRIED = (Busy, 2, "transient")  # run again, then the caller is told busy
BUSY = (Busy, 1, "unavailable")  # the caller is told busy at once
RECONNECTED = (Busy, 2, "lost")  # run again once on another connection, then busy
REFUSED = (StoreError, 1, "refused")  # a bug: a StoreError, not retried
OUTCOMES = {
    "23505": (AlreadyExists, 2, "conflict"),  # unique_violation, again on the retry: a duplicate
    "40001": RETRIED,  # serialization_failure
    "40P01": RETRIED,  # deadlock_detected
    "55P03": RETRIED,  # lock_not_available
    "40000": RETRIED,  # transaction_rollback: its class
    "57014": BUSY,  # query_canceled
    "53100": BUSY,  # disk_full: class 53
    "53300": BUSY,  # too_many_connections
    "58030": BUSY,  # io_error: class 58
    "57P01": RECONNECTED,  # admin_shutdown
    "57P03": RECONNECTED,  # cannot_connect_now
    "08006": RECONNECTED,  # connection_failure: class 08
    "22P02": REFUSED,  # invalid_text_representation
    "22003": REFUSED,  # numeric_value_out_of_range
    "23514": REFUSED,  # check_violation
    "23503": REFUSED,  # foreign_key_violation
    "40002": REFUSED,  # transaction_integrity_constraint_violation
    "42P01": REFUSED,  # undefined_table
}


@pytest.mark.parametrize("code", OUTCOMES)
def test_each_sqlstate_class_ends_in_the_stores_own_error(pg, code):
    raises, runs, counted = OUTCOMES[code]
    attempts = []

    def fails(tx) -> None:
        attempts.append(1)
        raise errors.lookup(code)("the server's text, never shown")

    with pytest.raises(raises) as raised:
        pg.transact(fails, attempts=2)
    assert type(raised.value) is raises
    assert len(attempts) == runs
    assert pg.stats()[counted] == runs and pg.stats()["retried"] == runs - 1
    assert "never shown" not in str(raised.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seed_rate_past_the_integer_column_is_refused_whole_with_a_clear_error(backend, tmp_path):
    def with_rate(cents: int):
        first = replace(TEST_HOTEL.rooms[0], weekday_cents=cents)
        return replace(TEST_HOTEL, rooms=(first, *TEST_HOTEL.rooms[1:]))

    horizon = [(None, TODAY, TODAY + timedelta(days=400))]
    with hotel_support.seeded_store(backend, tmp_path, data=None) as store:
        with pytest.raises(StoreError) as raised:
            seed(store, TODAY, with_rate(10**20))
        assert str(raised.value).startswith(
            f"the nightly rate in cents for standard_queen on {TODAY} is 100000000000000000000, "
            "out of range: it must be a whole number from 0 to 2,147,483,647"
        )
        assert store.transact(lambda tx: tx.hotel()) is None  # nothing of the seed was written
        assert store.transact(lambda tx: tx.nights(horizon)) == []
        assert store.stats()["refused"] == 1

        assert seed(store, TODAY, with_rate(INTEGER_MAX)) > 0  # the largest rate the column holds
        rates = {
            n.rate_cents
            for n in store.transact(
                lambda tx: tx.nights([("standard_queen", TODAY, TODAY + timedelta(days=7))])
            )
        }
        assert INTEGER_MAX in rates
