"""The worker's end of its engine's door (engine/door/host.py): admissions, their release, the engine's load
and the drain, asked with the worker's own key (engine/door/gate.py `control`) on one connection kept open, so
no crowd of other connections to the door stands between the worker and its engine. Knows the wire format;
nothing of sessions, LiveKit or the model.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, NamedTuple

from engine.api import (
    Admit,
    AskLoad,
    Control,
    Drain,
    EngineClosed,
    EngineError,
    EngineSnapshot,
    Release,
    ReportFleet,
)
from engine.transport.wire import connect, control_message, encode, raise_error, read_line

REQUEST_TIMEOUT_S = 10.0  # an answer, or EngineClosed


class EngineFigures(NamedTuple):
    """What `EngineControl.figures` reads of the engine: its snapshot, its live steps in ms over the
    accounting window (oldest first: the last n are the latest n ticks'), its process's resident memory and C
    heap in use (None where the C library is not glibc), in bytes, and its snapshot endpoint's port (None
    without one)."""

    snapshot: EngineSnapshot
    live_ms: list[float]
    rss_bytes: int
    heap_bytes: int | None
    port: int | None


class EngineControl:
    """The engine at `address`, as its worker asks it, with the worker's `key`. Questions from any thread,
    one at a time; a connection that failed is made again for the next question (EngineClosed when the
    engine cannot be reached, or refuses the key)."""

    def __init__(self, address: str, key: str, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.address, self.timeout = address, timeout
        self._key = key
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._rx = bytearray()

    def _ask(self, request: Control) -> dict[str, Any]:
        """One question and its answer; the connection is made again once if the kept one has failed."""
        msg = control_message(request)
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                if fresh:
                    self._sock, self._rx = connect(self.address, self.timeout, self._key), bytearray()
                try:
                    self._sock.sendall(encode(msg))
                    reply = read_line(self._sock, self._rx)
                except (OSError, EngineClosed, ValueError):
                    self._reset()
                    if fresh or attempt:
                        raise
                    continue
                if reply.get("op") == "refused":
                    self._reset()  # the door closes a connection it refused the key of
                    raise EngineClosed(f"the engine refused the worker ({str(reply.get('why'))[:200]})")
                raise_error(reply)
                return reply
        raise EngineClosed("the engine is not reachable")  # not reached: the second try raises

    def _reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None

    def admit(self, job: str) -> str:
        """Reserve a slot for a job the worker is about to accept (the engine's EngineFull, EngineOverloaded
        or EngineClosed otherwise); the job's session takes it by naming the job
        (`RemoteEngine.open_session(admission=)`)."""
        return str(self._ask(Admit(job))["admission"])

    def release(self, admission: str) -> None:
        """Give back the slot reserved for this job (it ended before it opened a session); best effort."""
        with contextlib.suppress(OSError, EngineError, ValueError):
            self._ask(Release(admission))

    def drain(self, seconds: float) -> None:
        """Tell every room with a session that the worker drains: its calls have `seconds` left."""
        with contextlib.suppress(OSError, EngineError, ValueError):
            self._ask(Drain(float(seconds)))

    def report_fleet(self, redispatches: dict[str, int]) -> None:
        """The worker's new agents for rooms alone, by reason (agent/fleet/fleet.py), for the engine's
        snapshot and /metrics; best effort."""
        with contextlib.suppress(OSError, EngineError, ValueError):
            self._ask(ReportFleet(dict(redispatches)))

    def status(self) -> dict[str, Any]:
        """The engine's load as the worker reports it, its occupancy, free slots, slots, and whether its tick
        runs."""
        return self._ask(AskLoad())

    def figures(self) -> EngineFigures:
        """The engine's snapshot, its live steps over the accounting window, its process's memory and its
        snapshot endpoint's port (EngineClosed, or the engine's EngineError, when it cannot answer)."""
        reply = self._ask(AskLoad(figures=True))
        return EngineFigures(
            EngineSnapshot.model_validate(reply["snapshot"]),
            [float(ms) for ms in reply["live_ms"]],
            int(reply["rss_bytes"]),
            None if reply["heap_bytes"] is None else int(reply["heap_bytes"]),
            None if reply["port"] is None else int(reply["port"]),
        )

    @property
    def load(self) -> float:
        """What the worker tells LiveKit: 1.0 (full) when the engine cannot be reached."""
        try:
            return float(self.status()["load"])
        except (EngineError, OSError, ValueError, KeyError):
            return 1.0

    def close(self) -> None:
        with self._lock:
            self._reset()
