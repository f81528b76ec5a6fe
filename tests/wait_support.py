"""Waiting in the tests for an event, never for elapsed time: a predicate asked again until it holds. The
bound only stops a wait that would otherwise hang (the machine is shared), with an AssertionError naming
what was awaited. Knows nothing of what is waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_S = 90.0


def wait_until(
    predicate,
    what: str = "the condition",
    timeout: float = HANG_S,
    every: float = 0.02,
    seen: Callable[[], object] | None = None,
):
    """The first true value of `predicate()`, asked every `every` seconds for at most `timeout`; the error
    names what was awaited and, when `seen` is given, what it returns then."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(what, timeout, seen))
        time.sleep(every)
    return value


async def await_until(
    predicate,
    what: str = "the condition",
    timeout: float = HANG_S,
    every: float = 0.02,
    seen: Callable[[], object] | None = None,
):
    """`wait_until` in a coroutine: the event loop goes on between the questions."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(what, timeout, seen))
        await asyncio.sleep(every)
    return value


def _timed_out(what: str, timeout: float, seen: Callable[[], object] | None) -> str:
    tail = "" if seen is None else f"; last seen: {seen()}"
    return f"timed out waiting for {what} ({timeout:g} s){tail}"
