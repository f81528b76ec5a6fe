"""64 simultaneous callers on SQLite and PostgreSQL: the last room is sold exactly once, and the
database stays consistent under a mixed storm of bookings, changes and cancellations."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from datetime import date, timedelta
from pathlib import Path

import pytest

import hotel_support
from hotel_support import TODAY, booking, cancelling
from tools.audit import audit
from tools.errors import HotelError, SoldOut
from tools.replies import KEY_REUSED

CALLERS = 64
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=hotel_support.BACKENDS)
def store(request, tmp_path):
    # one connection per caller: all 64 really race inside the database, none waits in our pool
    with hotel_support.seeded_store(request.param, tmp_path, pool_size=CALLERS) as s:
        yield s


def race(n: int, attempt) -> list[object]:
    """Run attempt(i) on n threads released together; each result or exception, in caller order."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = attempt(i)
        except BaseException as exc:  # noqa: BLE001 (every outcome is asserted on)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    return results


def test_64_callers_want_the_last_room_exactly_one_gets_it(store):
    hotel = hotel_support.hotel(store)
    results = race(
        CALLERS,
        lambda i: hotel.call(
            "book_room", booking(guest_name=f"Caller {chr(65 + i % 26)}. Smith"), session=f"call-{i}"
        ),
    )
    booked = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, SoldOut)]
    others = [r for r in results if not isinstance(r, dict | SoldOut)]
    assert others == [], others[:3]
    assert (len(booked), len(refused)) == (1, CALLERS - 1)
    assert booked[0]["status"] == "confirmed"
    assert {e.message for e in refused} == {
        "No Deluxe King rooms are left on Tuesday the 12th; a Standard Queen is available for those dates "
        "at $229.50 including tax."
    }
    reservations = store.transact(lambda tx: tx.reservations())
    assert [r.code for r in reservations] == [booked[0]["confirmation_code"]]
    nights = store.transact(lambda tx: tx.nights([("deluxe_king", date(2030, 3, 12), date(2030, 3, 14))]))
    assert [(n.booked, n.total) for n in nights] == [(1, 1), (1, 1)]
    assert audit(store) == []


_WORKER = textwrap.dedent(
    """
    import json, sys, threading, time
    from datetime import date
    from tools.errors import SoldOut
    from tools.hotel import Hotel
    from tools.store import open_store
    from tools.settings import StoreSettings
    worker, threads, start_at = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    key = sys.argv[4] if len(sys.argv) > 4 else None  # one key for every request: a retried booking
    hotel = Hotel(open_store(StoreSettings.from_env()), today=lambda: date(2030, 3, 4))
    outcomes = []
    def attempt(i):
        time.sleep(max(0.0, start_at - time.time()))
        contact = "+15550000000" if key else f"+1555000{worker:02d}{i:02d}"
        try:
            booking = {"guest_name": "Ada Lovelace", "contact": contact, "check_in": "2030-03-12",
                       "nights": 2, "guests": 2, "room_type": "deluxe"}
            view = hotel.book_room(booking, idempotency_key=key)
            outcomes.append(view["confirmation_code"] if key else "booked")
        except SoldOut:
            outcomes.append("sold_out")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    ts = [threading.Thread(target=attempt, args=(i,)) for i in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    hotel.store.close()
    print(json.dumps(outcomes))
    """
)


def run_workers(store, processes: int, threads: int, *key: str) -> Counter[str]:
    """Each process books the last deluxe room from `threads` threads, all released together; the outcomes."""
    env = {**hotel_support.store_env(store), "CHORUS_DB_POOL_SIZE": str(threads)}
    start_at = time.time() + 2.0
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(w), str(threads), str(start_at), *key],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(processes)
    ]
    outcomes: Counter[str] = Counter()
    for w in workers:
        out, err = w.communicate(timeout=180)
        assert w.returncode == 0, err
        outcomes.update(json.loads(out.strip().splitlines()[-1]))
    return outcomes


def test_64_callers_in_four_worker_processes_sell_the_last_room_once(store):
    # Four processes (four LiveKit workers on one database), 16 callers each, released together.
    outcomes = run_workers(store, 4, 16)
    assert outcomes == Counter({"booked": 1, "sold_out": CALLERS - 1})
    assert len(store.transact(lambda tx: tx.reservations())) == 1
    assert audit(store) == []


def test_a_booking_retried_16_times_at_once_for_the_last_room_gets_one_code_every_time(store):
    """The same booking (one idempotency key, or the same details again in one call) sent 16 times at once for
    the last room: every answer is that booking, none is "sold out"; one reservation, one room taken."""
    hotel = hotel_support.hotel(store)
    same_key = race(16, lambda i: hotel.book_room(booking(), idempotency_key="retry-1"))
    again = booking(check_in="2030-04-12", nights=2)
    same_call = race(16, lambda i: hotel.call("book_room", again, session="call-7"))
    for results in (same_key, same_call):
        assert [type(r).__name__ for r in results if not isinstance(r, dict)] == []
        assert len({r["confirmation_code"] for r in results}) == 1
        assert sorted(r["already_booked"] for r in results) == [False] + [True] * 15
    assert len(store.transact(lambda tx: tx.reservations())) == 2
    assert audit(store) == []


def test_a_retried_booking_from_four_worker_processes_gets_one_code(store):
    outcomes = run_workers(store, 4, 4, "retry-from-4-workers")
    assert len(outcomes) == 1 and sum(outcomes.values()) == 16, outcomes
    assert "sold_out" not in outcomes
    assert len(store.transact(lambda tx: tx.reservations())) == 1
    assert audit(store) == []


def test_a_key_reused_for_another_booking_is_refused(store):
    hotel = hotel_support.hotel(store)
    first = hotel.book_room(booking(), idempotency_key="k-1")
    with pytest.raises(HotelError) as refused:
        hotel.book_room(booking(guest_name="Grace Hopper"), idempotency_key="k-1")
    assert refused.value.message == KEY_REUSED
    again = hotel.book_room(booking(), idempotency_key="k-1")  # the same request again is still answered
    assert again["confirmation_code"] == first["confirmation_code"] and again["already_booked"] is True
    assert [r.guest_name for r in store.transact(lambda tx: tx.reservations())] == ["Ada Lovelace"]
    assert audit(store) == []


def test_a_storm_of_bookings_changes_and_cancellations_never_overbooks(store):
    hotel = hotel_support.hotel(store)
    # A few bookings to change and cancel, then 64 callers doing random things to a tiny hotel.
    codes = [
        hotel.book_room(booking(room_type="standard", check_in=f"2030-03-{10 + i}", nights=1))[
            "confirmation_code"
        ]
        for i in range(3)
    ]

    def caller(i: int) -> str:
        rng = random.Random(i)
        done = []
        for _ in range(4):
            start = (TODAY + timedelta(days=rng.randrange(5, 12))).isoformat()
            room = rng.choice(["standard", "deluxe", "suite"])
            try:
                kind = rng.random()
                if kind < 0.6:
                    hotel.book_room(booking(check_in=start, nights=rng.randrange(1, 3), room_type=room))
                    done.append("book")
                elif kind < 0.85:
                    hotel.change_or_cancel_reservation(
                        {
                            "confirmation_code": rng.choice(codes),
                            "last_name": "Lovelace",
                            "action": "change",
                            "check_in": start,
                            "room_type": room,
                        }
                    )
                    done.append("change")
                else:
                    hotel.change_or_cancel_reservation(cancelling(rng.choice(codes)))
                    done.append("cancel")
            except HotelError as exc:
                done.append(exc.code)
        return ",".join(done)

    results = race(CALLERS, caller)
    failures = [r for r in results if not isinstance(r, str)]
    assert failures == [], failures[:3]
    kinds = Counter(k for r in results for k in r.split(","))  # type: ignore[union-attr]
    assert kinds["book"] > 0 and kinds["sold_out"] > 0 and kinds["busy"] == 0, kinds
    assert audit(store) == []
    nights = store.transact(lambda tx: tx.nights([(None, TODAY, TODAY + timedelta(days=14))]))
    assert all(0 <= n.booked <= n.total for n in nights)
