"""A room's process: what it makes once and its jobs share (under the thread executor, the worker's process
and its job threads): its settings, read from the environment; the worker's engine as the process reaches it
(engine/client/remote.py), whose drain begins the process's drain; its one booking store, with its own
connection pool; and `prewarm`, which readies the process before its first job (the rtc SDK's FFI client, a
lower priority for a process of its own, the engine's door and its tokenizer, the long-lived objects frozen
out of the collector). `close_room` forgets them between tests. Knows livekit-agents' job processes and the
engine's client; nothing of a call.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from livekit.agents import JobProcess

from agent import telemetry
from agent.audio_in import rtc_ffi
from agent.settings import AgentSettings
from engine.process.collector import freeze_long_lived

if TYPE_CHECKING:
    from engine.client.remote import RemoteEngine

_lock = threading.Lock()
_hotel: Any = None


def shared_hotel() -> Any:
    """The process's one booking store (its own connection pool), opened on first use: never created nor
    migrated here (the worker migrated it at start, agent/fleet/kept.py), so an open never waits on the
    write lock another room's process holds; a store not migrated is refused with a StoreError."""
    global _hotel
    if _hotel is None:
        with _lock:
            if _hotel is None:
                from tools.hotel import Hotel
                from tools.store import open_store

                _hotel = Hotel(open_store(migrate=False))
    return _hotel


_room: dict[str, Any] = {}  # this process's settings and the engine it reaches
# the rtc runtime's worker threads in a room's own process (`CHORUS_ROOM_RTC_THREADS`; 0: tokio's default, one
# per core of the host, in every call's process): one call's media needs one
ROOM_RTC_THREADS = 1


def room_settings() -> AgentSettings:
    if "settings" not in _room:
        _room["settings"] = AgentSettings.from_env()
    return _room["settings"]


def room_engine() -> RemoteEngine:
    """The worker's engine as this process reaches it (engine/client/remote.py), made once per process."""
    if "engine" not in _room:
        from agent.draining import DRAIN
        from engine.client.remote import RemoteEngine

        engine = RemoteEngine()
        engine.on_drain = DRAIN.begin
        _room["engine"] = engine
    return _room["engine"]


def proc_is_own_process() -> bool:
    """This job runner is a room's own process (the process executor), not a thread of the worker's."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def prewarm(proc: JobProcess) -> None:
    """A room's process (or, under the thread executor, a job runner) before its job: the rtc SDK's FFI
    client, the engine's door and its tokenizer, then the long-lived objects frozen out of the collector."""
    if proc_is_own_process():
        rtc_threads(int(os.environ.get("CHORUS_ROOM_RTC_THREADS", ROOM_RTC_THREADS)))
    rtc_ffi.install(room_settings().native_audio)  # before any job of this process touches the rtc SDK
    telemetry.configure("room")  # this process's spans (agent/telemetry.py): the worker's settings
    if proc_is_own_process():
        # a room's audio can wait a few milliseconds; the tick, the LiveKit server and the callers' network
        # cannot: on a machine short of cores the rooms yield first
        os.nice(room_settings().room_nice)
    engine = room_engine()
    _ = engine.tokens
    proc.userdata["engine"] = engine
    freeze_long_lived()  # the job process's own objects, once


def rtc_threads(n: int) -> None:
    """Size the rtc runtime's worker pool (tokio reads TOKIO_WORKER_THREADS when the runtime starts, which
    is when this process's FFI client is made): `n` threads, or tokio's default for 0 or an operator's own
    TOKIO_WORKER_THREADS."""
    if n > 0:
        os.environ.setdefault("TOKIO_WORKER_THREADS", str(n))


def close_room() -> None:
    """Close this process's store and forget its engine (between tests)."""
    global _hotel
    with _lock:
        if _hotel is not None:
            _hotel.store.close()
        _hotel = None
        _room.clear()
