"""Rooms of one worker process join a few at a time (agent/joins.py): across the job threads' own event
loops no more than the limit are inside their turn at once, the others wait and are counted, a room cancelled
while it waits takes no turn with it, and 0 means no limit."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agent.joins import JoinGate


def join_from_threads(gate: JoinGate, rooms: int, hold_s: float) -> int:
    """`rooms` job threads, each with its own loop, each in its turn for `hold_s`: the most inside at once."""
    inside, most, lock = 0, 0, threading.Lock()

    async def join() -> None:
        nonlocal inside, most
        async with gate.turn():
            with lock:
                inside += 1
                most = max(most, inside)
            await asyncio.sleep(hold_s)
            with lock:
                inside -= 1

    threads = [threading.Thread(target=asyncio.run, args=(join(),)) for _ in range(rooms)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return most


def test_no_more_than_the_limit_join_at_once_and_the_rest_are_counted():
    gate = JoinGate(2)
    assert join_from_threads(gate, 6, 0.2) == 2
    assert gate.waited >= 4  # six arrived together; two went in


def test_no_limit_lets_every_room_in():
    gate = JoinGate(0)
    assert join_from_threads(gate, 6, 0.2) == 6
    assert gate.waited == 0


def test_a_room_cancelled_while_it_waits_takes_no_turn_with_it():
    gate = JoinGate(1)

    async def main() -> None:
        async with gate.turn():
            waiting = asyncio.ensure_future(gate.turn().__aenter__())
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        t0 = time.monotonic()
        async with gate.turn():  # the one turn there is: free again
            pass
        assert time.monotonic() - t0 < 0.1

    asyncio.run(main())
