"""The hotel's answers stay true and arrive in time when the database stops answering or loses connections.

A real PostgreSQL server is frozen (SIGSTOP on every process of it) in the middle of bookings, its backends
are ended with `pg_terminate_backend` during calls, and the answer to a COMMIT is dropped on its way back by
a TCP relay; a SQLite write lock is held by another connection. Each test checks what the tool said (the
text the model would hear) against the rows in the database afterwards: every answer comes before the engine
stops waiting for the tool, "booked" means the row is there, "busy" means it is not, and an answer that says
the outcome is unknown is followed by a retry that finds how it stands. No database error reaches the caller.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import hotel_support
from hotel_support import TEST_HOTEL, TODAY, booking
from tools.audit import audit
from tools.errors import Busy, HotelError, Unconfirmed
from tools.hotel import Hotel
from tools.store import Store
from wait_support import wait_until

pytestmark = pytest.mark.serial  # PostgreSQL, which a test here freezes (tests/conftest.py)

APP = "chorus-hotel"  # the application_name of the store's connections
SLOW_GUEST = "Slow Commit"  # a booking for this guest spends a while inside its COMMIT (slow_commits)
LOCKED = "wait_event_type = 'Lock'"  # a backend waiting for a row lock
IN_COMMIT = "wait_event = 'PgSleep'"  # a backend inside the slow COMMIT
HANG_S = 20.0  # no wait below takes this long unless the store hangs


def tool_timeout_s() -> float:
    """How long the engine waits for a tool before telling the model it did not answer."""
    from engine.tick.engine import EngineConfig

    return float(EngineConfig.model_fields["tool_timeout_s"].default)


@pytest.fixture
def pg(tmp_path) -> Iterator[Store]:
    with hotel_support.seeded_store("postgres", tmp_path) as store:
        yield store


def admin(store: Store) -> psycopg.Connection:
    """A connection of the test's own (not the store's): autocommit, in the store's schema."""
    url, schema = store.url, store.schema  # type: ignore[attr-defined]
    conn = psycopg.connect(url, autocommit=True, application_name="chorus-test")
    conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
    return conn


def slow_commits(store: Store, seconds: float) -> None:
    """Bookings for SLOW_GUEST spend `seconds` in their COMMIT: a deferred trigger in this test's schema."""
    with admin(store) as conn:
        conn.execute(
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.guest_name = '{SLOW_GUEST}' THEN PERFORM pg_sleep({seconds}); END IF; "
            "RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON reservations "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()"
        )


def backends(conn: psycopg.Connection, where: str = "true") -> list[int]:
    """Pids of the store's backends that match a pg_stat_activity condition."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database() "
        f"AND {where} ORDER BY pid",
        [APP],
    ).fetchall()
    return [r[0] for r in rows]


def terminate(conn: psycopg.Connection, pid: int) -> None:
    conn.execute("SELECT pg_terminate_backend(%s)", [pid])


@contextmanager
def rows_locked(store: Store, room_type: str, first: str, last: str) -> Iterator[psycopg.Connection]:
    """Another client holds the inventory rows of [first, last) locked until the block ends."""
    conn = admin(store)
    try:
        conn.execute("BEGIN")
        conn.execute(
            "SELECT * FROM inventory WHERE room_type = %s AND night >= %s AND night < %s FOR UPDATE",
            [room_type, first, last],
        )
        yield conn
    finally:
        if not conn.closed:
            conn.execute("ROLLBACK")
        conn.close()


class Call:
    """One tool call on its own thread, as the agent makes it: what it answered, and after how long."""

    def __init__(self, hotel: Hotel, name: str, arguments: dict, session: str):
        self.hotel, self.name, self.arguments, self.session = hotel, name, arguments, session
        self.answer: dict | BaseException | None = None
        self.took_s: float | None = None
        self._started = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.answer = self.hotel.call(self.name, self.arguments, session=self.session)
        except BaseException as exc:  # noqa: BLE001 (every outcome is asserted on)
            self.answer = exc
        self.took_s = time.monotonic() - self._started

    @property
    def done(self) -> bool:
        return self.took_s is not None

    def again(self) -> Call:
        """The same call, made again in the same conversation."""
        return Call(self.hotel, self.name, self.arguments, self.session)

    def wait(self, timeout: float = 60.0) -> Call:
        self.thread.join(timeout)
        assert self.done, f"{self.name} did not answer within {timeout} s"
        return self

    @property
    def said(self) -> str:
        """The text the model hears: the result's message, or the tool error's."""
        if isinstance(self.answer, dict):
            return self.answer["message"]
        if isinstance(self.answer, HotelError):
            return self.answer.message
        return f"(raised {type(self.answer).__name__}: {self.answer})"


def booked(call: Call) -> bool:
    return isinstance(call.answer, dict) and call.said.startswith(("Booked", "This booking was already made"))


def guests_booked(store: Store, guest: str) -> list[str]:
    """Confirmation codes of the reservations in the database for `guest`."""
    return [r.code for r in store.transact(lambda tx: tx.reservations()) if r.guest_name == guest]


def settle_backends(conn: psycopg.Connection) -> None:
    """Wait until no backend of the store is inside a statement or a transaction."""
    wait_until(lambda: not backends(conn, "state <> 'idle'"), "the store's backends to finish", HANG_S)


# --- a frozen server --------------------------------------------------------------------------------------


def children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == parent:  # the field after the name is the ppid
                found.append(int(entry.name))
    return found


def postmaster(conn: psycopg.Connection) -> int:
    """The server's postmaster pid (the first line of $PGDATA/postmaster.pid); skip (fail under CI=true)
    when this process cannot signal it."""
    data_dir = conn.execute("SHOW data_directory").fetchone()[0]
    try:
        pid = int(Path(data_dir, "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError) as exc:
        reason = f"cannot signal the PostgreSQL server in {data_dir} ({type(exc).__name__}): it must be local"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return pid


@contextmanager
def frozen(server: int) -> Iterator[None]:
    """Every process of the server stopped (SIGSTOP) for the block, continued (SIGCONT) however it ends."""
    stopped: list[int] = []
    try:
        for pid in [server, *children(server)]:  # the postmaster first: it starts no one new
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield
    finally:
        for pid in reversed(stopped):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_frozen_server_answers_every_call_in_time_and_the_rows_agree_with_the_answers(pg):
    """Six calls meet a stopped server: two bookings waiting on a row lock, one inside its COMMIT, three
    that start once it has stopped. Each answers before the engine's tool timeout while the server is still
    stopped; after it continues, a booking said to be made is there, one said busy is not, and one whose
    outcome was unknown is found as it stands by asking again."""
    limit = tool_timeout_s()
    slow_commits(pg, 3.0)
    hotel = hotel_support.hotel(pg)
    watch = admin(pg)
    server = postmaster(watch)
    suite = booking(guest_name=SLOW_GUEST, room_type="suite")
    calls: dict[str, Call] = {}
    with rows_locked(pg, "deluxe_king", "2030-03-12", "2030-03-14"):
        calls["waits on a row lock"] = Call(hotel, "book_room", booking(), "s1")
        calls["waits on the same lock"] = Call(hotel, "book_room", booking(guest_name="Grace Hopper"), "s2")
        calls["inside its COMMIT"] = Call(hotel, "book_room", suite, "s3")
        wait_until(
            lambda: len(backends(watch, LOCKED)) == 2 and backends(watch, IN_COMMIT),
            "two bookings waiting on the lock and one inside its COMMIT",
            HANG_S,
        )
        with frozen(server):
            frozen_at = time.monotonic()
            standard = booking(
                guest_name="Alan Turing", room_type="standard", check_in="2030-03-20", nights=2
            )
            calls["starts frozen: booking"] = Call(hotel, "book_room", standard, "s4")
            stay = {"check_in": "2030-03-20", "nights": 2, "guests": 2}
            calls["starts frozen: availability"] = Call(hotel, "check_availability", stay, "s5")
            calls["starts frozen: information"] = Call(hotel, "hotel_info", {"topic": "parking"}, "s6")
            deadline = frozen_at + limit + 1
            while time.monotonic() < deadline and not all(c.done for c in calls.values()):
                time.sleep(0.05)
            answered_frozen = {k for k, c in calls.items() if c.done}
            thawed_after = time.monotonic() - frozen_at
    for c in calls.values():
        c.wait()
    settle_backends(watch)
    print(f"\nserver stopped for {thawed_after:.1f} s")
    for what, c in calls.items():
        print(f"  {what:28} {c.took_s:5.2f} s  {c.said[:100]}")
    late = {k: round(c.took_s, 2) for k, c in calls.items() if k not in answered_frozen or c.took_s >= limit}
    assert not late, f"answered only after the server came back, or after the engine's {limit:g} s: {late}"
    raised = {k: c.said for k, c in calls.items() if not isinstance(c.answer, dict | HotelError)}
    assert not raised, raised
    for what, c in calls.items():
        if c.name != "book_room":
            continue
        guest = c.arguments["guest_name"]
        there = guests_booked(pg, guest)
        if isinstance(c.answer, Unconfirmed):
            again = c.again().wait()  # what the model is told to do; the same conversation, so the same key
            print(f"  {what}, asked again: {again.said[:100]}")
            assert booked(again), (what, again.said)
            assert again.said.startswith("This booking was already made" if there else "Booked"), (
                there,
                again.said,
            )
            assert len(guests_booked(pg, guest)) == 1, what
        elif booked(c):
            assert there == [c.answer["confirmation_code"]], (what, there)
        else:
            assert isinstance(c.answer, Busy), (what, c.said)
            assert there == [], f"{what}: told busy, but booked {there}"
    assert audit(pg) == []
    watch.close()


# --- ended connections ------------------------------------------------------------------------------------


def test_a_connection_ended_during_a_booking_is_retried_once_on_another_and_books(pg):
    hotel = hotel_support.hotel(pg)
    watch = admin(pg)
    with rows_locked(pg, "deluxe_king", "2030-03-12", "2030-03-14"):
        call = Call(hotel, "book_room", booking(), "s1")
        wait_until(lambda: backends(watch, LOCKED), "the booking to wait on its nights", HANG_S)
        (first,) = backends(watch, LOCKED)
        terminate(watch, first)
        wait_until(
            lambda: call.done or backends(watch, LOCKED) not in ([], [first]),
            "the call to answer, or its retry to wait on the nights",
            HANG_S,
        )
    call.wait()
    print(f"\nanswered after {call.took_s:.2f} s: {call.said}")
    assert booked(call) and call.said.startswith("Booked"), call.said
    assert guests_booked(pg, "Ada Lovelace") == [call.answer["confirmation_code"]]
    assert audit(pg) == []
    watch.close()


def test_a_booking_whose_connection_is_ended_twice_is_told_busy_and_books_nothing(pg):
    hotel = hotel_support.hotel(pg)
    watch = admin(pg)
    ended: list[int] = []
    with rows_locked(pg, "deluxe_king", "2030-03-12", "2030-03-14"):
        call = Call(hotel, "book_room", booking(), "s1")
        end = time.monotonic() + 20
        while not call.done and time.monotonic() < end:
            for pid in backends(watch, LOCKED):
                if pid not in ended:
                    terminate(watch, pid)
                    ended.append(pid)
            time.sleep(0.02)
    call.wait()
    print(f"\nended {len(ended)} connections; answered after {call.took_s:.2f} s: {call.said}")
    assert isinstance(call.answer, Busy), call.said
    assert len(ended) == 2  # the attempt and its one retry
    assert guests_booked(pg, "Ada Lovelace") == []
    assert audit(pg) == []
    watch.close()


def test_a_connection_ended_inside_the_commit_is_settled_as_rolled_back_and_booked_once(pg):
    slow_commits(pg, 1.0)
    hotel = hotel_support.hotel(pg)
    watch = admin(pg)
    call = Call(hotel, "book_room", booking(guest_name=SLOW_GUEST), "s1")
    wait_until(lambda: backends(watch, IN_COMMIT), "the booking to be inside its COMMIT", HANG_S)
    (first,) = backends(watch, IN_COMMIT)
    terminate(watch, first)
    retries = set()
    while not call.done:  # the retry, once the first is settled as rolled back, enters its own COMMIT
        retries.update(pid for pid in backends(watch, IN_COMMIT) if pid != first)
        time.sleep(0.02)
    call.wait()
    print(f"\nanswered after {call.took_s:.2f} s: {call.said}")
    assert booked(call) and call.said.startswith("Booked"), call.said
    assert len(retries) == 1
    assert guests_booked(pg, SLOW_GUEST) == [call.answer["confirmation_code"]]
    assert audit(pg) == []
    watch.close()


class Relay:
    """A TCP relay to the PostgreSQL server that, once armed, lets the next COMMIT through and drops the
    server's answer to it, closing that connection: the network failed after the server committed."""

    def __init__(self, host: str, port: int):
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            state = {"dropping": False}
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, state), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, state: dict) -> None:
        try:
            while data := src.recv(65536):
                if up and b"COMMIT\x00" in data and self.armed.is_set():
                    self.armed.clear()
                    state["dropping"] = True
                elif not up and state["dropping"]:
                    self.dropped += 1
                    break  # the answer to the COMMIT never arrives
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()


def test_a_commit_whose_answer_is_lost_is_found_committed_and_told_as_booked():
    from tools.seed import seed
    from tools.store.postgres import PostgresStore

    url = hotel_support.postgres_url()
    info = psycopg.conninfo.conninfo_to_dict(url)
    relay = Relay(str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
    store = PostgresStore(
        make_conninfo(url, host="127.0.0.1", port=relay.port),
        schema=hotel_support.fresh_schema(),
        pool_size=2,
    )
    try:
        seed(store, TODAY, TEST_HOTEL)
        hotel = hotel_support.hotel(store)
        relay.armed.set()
        call = Call(hotel, "book_room", booking(), "s1").wait()
        print(f"\n{relay.dropped} answer dropped; answered after {call.took_s:.2f} s: {call.said}")
        assert relay.dropped == 1
        assert booked(call) and call.said.startswith("Booked"), call.said
        assert guests_booked(store, "Ada Lovelace") == [call.answer["confirmation_code"]]
        assert audit(store) == []
    finally:
        store.drop_schema()
        store.close()
        relay.close()


def test_no_database_error_reaches_the_caller_while_connections_are_ended_at_random(pg):
    """Forty calls on four threads while another client ends the store's busy backends over and over (a
    server that keeps crashing under them): each answer is one the model can read, a booking said made is
    in the database, one said busy is not, and the database stays consistent."""
    slow_commits(pg, 0.05)  # the slow guest's bookings hold their COMMIT open for a moment
    hotel = hotel_support.hotel(pg)
    watch = admin(pg)
    rng = random.Random(7)
    guests = [f"{first} {last}" for first in ("Ada", "Grace", "Alan", "Edsger") for last in ("Quinn", "Rowe")]
    plans = []
    for i in range(40):
        check_in = (TODAY + timedelta(days=6 + 2 * i)).isoformat()  # one stay per call
        if i % 4 == 0:
            plans.append(("check_availability", {"check_in": check_in, "nights": 2, "guests": 2}, None))
        else:
            guest = SLOW_GUEST if i % 4 == 1 else guests[i % len(guests)]
            room = rng.choice(["standard", "deluxe", "suite"])
            plans.append(
                ("book_room", booking(guest_name=guest, check_in=check_in, nights=2, room_type=room), guest)
            )
    outcomes: list[tuple[str, dict, Call]] = []
    stop = threading.Event()
    ended = []

    def killer() -> None:
        with admin(pg) as conn:
            while not stop.is_set():
                busy = backends(conn, "state <> 'idle'")
                if busy:
                    pid = rng.choice(busy)
                    terminate(conn, pid)
                    ended.append(pid)
                time.sleep(rng.uniform(0.005, 0.03))

    def caller(k: int) -> None:
        for i in range(k, len(plans), 4):
            name, args, _ = plans[i]
            call = Call(hotel, name, args, f"s{i}").wait()
            outcomes.append((name, args, call))

    kill = threading.Thread(target=killer, daemon=True)
    kill.start()
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    kill.join(10)
    settle_backends(watch)
    kinds: dict[str, int] = {}
    for _, _, c in outcomes:
        kind = type(c.answer).__name__
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"\nended {len(ended)} backends; answers: {kinds}")
    raised = [c.said for _, _, c in outcomes if not isinstance(c.answer, dict | HotelError)]
    assert not raised, raised
    assert len(outcomes) == 40 and ended
    rows = {(r.guest_name, r.check_in.isoformat()): r.code for r in pg.transact(lambda tx: tx.reservations())}
    for name, args, c in outcomes:
        if name != "book_room":
            continue
        there = rows.get((args["guest_name"], args["check_in"]))
        if booked(c):
            assert there == c.answer["confirmation_code"], c.said
        elif isinstance(c.answer, Busy):
            assert there is None, f"told busy, but booked {there}"
    assert audit(pg) == []
    watch.close()


# --- SQLite -----------------------------------------------------------------------------------------------


def test_a_sqlite_write_lock_held_elsewhere_is_told_busy_before_the_engine_gives_up(tmp_path):
    limit = tool_timeout_s()
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        hotel = hotel_support.hotel(store)
        other = sqlite3.connect(store.path, isolation_level=None)  # type: ignore[attr-defined]
        other.execute("BEGIN IMMEDIATE")  # another process writing, and not letting go
        try:
            call = Call(hotel, "book_room", booking(), "s1")
            end = time.monotonic() + limit + 1
            while not call.done and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            other.execute("ROLLBACK")
            other.close()
        call.wait()
        print(f"\nanswered after {call.took_s:.2f} s: {call.said}")
        assert call.took_s < limit
        assert isinstance(call.answer, Busy), call.said
        assert guests_booked(store, "Ada Lovelace") == []


def test_a_call_that_waited_past_its_deadline_before_it_ran_is_told_busy_and_books_nothing(tmp_path):
    """The agent dates the deadline from when the model's call reached it; a call that spent it all queued
    for a worker thread touches nothing."""
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        hotel = hotel_support.hotel(store)
        with pytest.raises(Busy):
            hotel.call("book_room", booking(), session="s1", deadline=time.monotonic() - 0.1)
        assert guests_booked(store, "Ada Lovelace") == []
        assert hotel.call("book_room", booking(), session="s1")["message"].startswith("Booked")
