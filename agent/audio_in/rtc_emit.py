"""The rtc SDK's event emitter without a signature inspected per event.

`rtc.EventEmitter.emit` (the version agent/audio_in names), the base of the rtc `Room` and of livekit-agents'
duplex sessions, calls `inspect.signature` on every callback each time it emits, to pass a callback only as
many positional arguments as it takes. A call emits a transcript delta with every frame of the agent's speech
and a room event for much of what the server says, so with 8 rooms that inspection was 6% of the rooms' Python
(py-spy, GIL samples). `install()` replaces `emit` with one that learns each callback's count once: it is kept
per function (weakly: a function that goes away takes its entry along), for a plain function and for a bound
method of it apart. Any other callable (a `functools.partial`, an object with `__call__`) is inspected as
before, every time. What is passed to each callback, the order, and what is raised or logged are the SDK's
own.
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from livekit.rtc import event_emitter

_ALL = -1  # the callback takes *args: every argument
_counts: weakref.WeakKeyDictionary[Callable, dict[bool, int]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # rooms emit from their own threads
_installed = False


def positional_count(callback: Callable) -> int:
    """How many positional arguments `callback` takes (_ALL: it has *args), as the SDK's `emit` reckons it."""
    params = inspect.signature(callback).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return _ALL
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def count_for(callback: Callable) -> int:
    if isinstance(callback, types.MethodType):
        fn, bound = callback.__func__, True
    elif isinstance(callback, types.FunctionType):
        fn, bound = callback, False
    else:
        return positional_count(callback)
    known = _counts.get(fn)
    if known is not None and bound in known:
        return known[bound]
    n = positional_count(callback)
    with _lock:
        _counts.setdefault(fn, {})[bound] = n
    return n


def emit(self: Any, event: Any, *args: Any) -> None:
    """`rtc.EventEmitter.emit`, with each callback's count of positional arguments learnt once."""
    if event in self._events:
        for callback in list(self._events[event]):
            try:
                n = count_for(callback)
                callback(*(args if n == _ALL else args[:n]))
            except TypeError:
                raise
            except Exception:  # noqa: BLE001 (as the SDK's emitter does: one listener's failure is logged, the others still run)
                event_emitter.logger.exception(f"failed to emit event {event}")


def install() -> bool:
    """Put `emit` in the SDK's emitter (idempotent). False, and the SDK's own kept, if its emitter is not the
    one this was written for."""
    global _installed
    with _lock:
        if _installed:
            return True
        if "signature" not in event_emitter.EventEmitter.emit.__code__.co_names:
            return False
        event_emitter.EventEmitter.emit = emit
        _installed = True
        return True
