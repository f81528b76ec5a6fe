"""Waiting in the tests for an event, never for elapsed time: a predicate asked again until it holds. The
bound only stops a wait that would otherwise hang (the machine is shared), with an AssertionError naming
what was awaited. Knows nothing of what is waited for.
"""

from __future__ import annotations

import asyncio
import time

HANG_S = 90.0


def wait_until(predicate, what: str = "the condition", timeout: float = HANG_S, every: float = 0.02):
    """The first true value of `predicate()`, asked every `every` seconds for at most `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)")
        time.sleep(every)
    return value


async def await_until(predicate, what: str = "the condition", timeout: float = HANG_S, every: float = 0.02):
    """`wait_until` in a coroutine: the event loop goes on between the questions."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)")
        await asyncio.sleep(every)
    return value
