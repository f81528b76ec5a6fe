"""The rtc SDK's process-wide FFI client, made safe and O(1) per event for many rooms in one process.

Every job of a worker is a thread with its own event loop, and all of them share the `livekit` rtc SDK's one
FFI client (the version agent/audio_in names). Two of its properties break a worker that serves many rooms:

- `FfiClient.instance` is created lazily, without a lock. Two job threads that touch it first at the same
  moment each create one; the native library's events go to the one stored last, and the other thread's
  `Room.connect` waits for a callback that never reaches its queue, until the native library gives up,
  reports a panic and the SDK SIGTERMs the whole worker. `install()` creates it once, under a lock, in
  every job runner's setup, before any job of the process can run.
- Its event queue hands every event to every subscriber, each through `call_soon_threadsafe` on the
  subscriber's loop: each room's received audio frames go to every room's audio stream, and each
  captured frame's callback to every room. With N rooms that is N² cross-thread wake-ups (measured with 8
  rooms: 230 events/s delivered 3,300 times). `RoutedQueue` sends an audio stream's events to the loop that
  owns the stream, a request's callback to the loop that made the request, and a room's events to the loop
  that connected it; anything it cannot place (an event that came before its owner was recorded, track
  events) still goes to every subscriber, as before. Its subscribers and their filters are the SDK's own.
- Its event emitter inspects every callback's signature each time it emits; `install()` puts in one that
  learns it once (agent/audio_in/rtc_emit.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from typing import Any

from livekit.rtc._utils import Queue  # the SDK's own subscriber queue

from agent.audio_in import audio_pump, rtc_emit

log = logging.getLogger("chorus.agent.rtc_ffi")

ASYNC_IDS_KEPT = 8192  # requests whose callback is still to come (a callback comes within milliseconds)
_lock = threading.Lock()
_installed = False


def install(native_audio: bool = False) -> bool:
    """Create the FFI client once and route its events (idempotent; False if the SDK is not the one this
    was written for, which then keeps its own queue). With `native_audio`, the client is made with
    the native callback in front of the SDK's (agent/audio_in/audio_pump.py) when it can be."""
    global _installed
    from livekit import rtc
    from livekit.rtc._ffi_client import FfiClient, FfiQueue  # the SDK's singleton; no public accessor

    with _lock:
        if native_audio and not _installed:
            audio_pump.install()
        client = FfiClient.instance  # created here, under the lock
        if _installed:
            return True
        rtc_emit.install()
        if not (isinstance(getattr(client, "_queue", None), FfiQueue) and hasattr(rtc.AudioStream, "_run")):
            log.warning(
                "livekit rtc %s: its FFI queue is not the one expected; events are not routed",
                rtc.__version__,
            )
            _installed = True
            return False
        routed = RoutedQueue()
        with client._queue._lock:
            for sub in client._queue._subscribers:  # nothing subscribed before is lost
                routed._add(*sub)
            client._queue = routed
        request = client.request

        def routed_request(req: Any) -> Any:
            resp = request(req)
            routed.record_request(resp)
            return resp

        client.request = routed_request
        _route_audio_streams(rtc.AudioStream, routed)
        _installed = True
        return True


class _Inbox:
    """The events on their way to one loop. The callback thread appends and wakes the loop only when no
    wake-up is pending; the loop hands everything that came meanwhile to its queues in order. One write to
    the loop's self-pipe per wake-up instead of one per event (with 16 rooms, those writes were a fifth of
    the worker's Python time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[Any, Any]] = deque()
        self.scheduled = False

    def deliver(self, queue: Any, item: Any) -> bool:
        """(The callback thread.) False when the loop is closed."""
        self.items.append((queue, item))
        if not self.scheduled:
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:
                self.items.clear()
                self.scheduled = False
                return False
        return True

    def drain(self) -> None:
        """(The loop's thread.) Cleared first: what is appended after this is either taken below or wakes the
        loop again."""
        self.scheduled = False
        items = self.items
        while items:
            queue, item = items.popleft()
            queue.put_nowait(item)


def _route_audio_streams(cls: type, routed: RoutedQueue) -> None:
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        routed.record_stream(self._ffi_handle.handle, self._loop)

    cls.__init__ = __init__


class RoutedQueue:
    """`FfiQueue`'s interface (subscribe, unsubscribe, put), delivering an event to its owner's loop when the
    owner is known, else to every subscriber.

    `put` runs on the native library's callback thread for every event of every room and takes no lock: the
    subscriber lists are immutable tuples, replaced whole (under `_lock`) by the subscribing threads, so a
    delivery never waits for a job thread that holds a lock while it waits for the GIL (with one lock on both
    sides, 16 rooms queued behind each other on it for hundreds of milliseconds at a time).

    A finalizer may re-enter it on a thread that is mid-update: a collection, started by any allocation of
    the update (its new tuples), finalizes a dead `rtc.Room`, whose `__del__` unsubscribes its queue. `_lock`
    is re-entrant, so that thread does not wait on itself for good, and a change asked for during an update
    is queued and applied by the update under way once its own is made (`_update`): applied at once, the
    outer update's tuples, built from the tables before it, would bring back what it removed."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # writers of the tables below; `put` only reads them
        self._updating = False  # (under `_lock`) a subscriber change is being made, on the lock's thread
        self._changes: deque[tuple[Any, tuple]] = deque()  # (under `_lock`) those asked for meanwhile
        self._subscribers: tuple[tuple[Any, asyncio.AbstractEventLoop, Any], ...] = ()
        self._of_loop: dict[
            asyncio.AbstractEventLoop, tuple[tuple[Any, asyncio.AbstractEventLoop, Any], ...]
        ] = {}
        self._by_async_id: OrderedDict[int, asyncio.AbstractEventLoop] = OrderedDict()
        self._by_stream: dict[int, asyncio.AbstractEventLoop] = {}
        self._by_room: dict[int, asyncio.AbstractEventLoop] = {}
        self._has_async_id: dict[str, bool] = {}
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}

    @property
    def subscriber_count(self) -> int:
        """Subscribers now (one whose loop closed is dropped at the first event that reaches it)."""
        return len(self._subscribers)

    # the SDK's FfiQueue interface

    def subscribe(self, loop: asyncio.AbstractEventLoop | None = None, filter_fn: Any = None) -> Any:
        queue = Queue()
        self._add(queue, loop or asyncio.get_event_loop(), filter_fn)
        return queue

    def unsubscribe(self, queue: Any) -> None:
        self._update(self._unsubscribe, queue)

    def _add(self, queue: Any, loop: asyncio.AbstractEventLoop, filter_fn: Any) -> None:
        self._update(self._insert, (queue, loop, filter_fn))

    def _update(self, change: Any, *args: Any) -> None:
        """Make a change to the subscriber tables, after any asked for while it is made (by a finalizer that
        a collection ran on this thread, mid-change). One asked for in the instant between the last queued
        change applied and `_updating` cleared waits for the next update (a frame's, milliseconds away)."""
        with self._lock:
            self._changes.append((change, args))
            if self._updating:
                return  # re-entered mid-update: the update under way applies it
            self._updating = True
            try:
                while self._changes:
                    change, args = self._changes.popleft()
                    change(*args)
            finally:
                self._updating = False

    def _unsubscribe(self, queue: Any) -> None:
        """(Through `_update`.)"""
        for sub in self._subscribers:
            if sub[0] is queue:
                self._remove(sub)
                break

    def _insert(self, sub: tuple) -> None:
        """(Through `_update`.)"""
        self._subscribers = (*self._subscribers, sub)
        self._of_loop[sub[1]] = (*self._of_loop.get(sub[1], ()), sub)

    def _remove(self, sub: tuple) -> None:
        """(Through `_update`.)"""
        if not any(s is sub for s in self._subscribers):
            return  # already gone
        self._subscribers = tuple(s for s in self._subscribers if s is not sub)
        mine = tuple(s for s in self._of_loop.get(sub[1], ()) if s is not sub)
        if mine:
            self._of_loop[sub[1]] = mine
        else:
            self._of_loop.pop(sub[1], None)

    def put(self, item: Any) -> None:
        owner = self.owner(item)
        subs = self._subscribers if owner is None else self._of_loop.get(owner, ())
        dead = []
        for sub in subs:
            queue, loop, filter_fn = sub
            if filter_fn is not None:
                try:
                    if not filter_fn(item):
                        continue
                except Exception:  # noqa: BLE001 (as the SDK does: a filter that fails lets the event through)
                    pass
            if not self._inbox(loop).deliver(queue, item):
                dead.append(sub)  # its loop closed without unsubscribing: it can never take an event again
        for sub in dead:
            self._update(self._remove, sub)

    def _inbox(self, loop: asyncio.AbstractEventLoop) -> _Inbox:
        inbox = self._inboxes.get(loop)
        if inbox is None:
            with self._lock:
                inbox = self._inboxes.setdefault(loop, _Inbox(loop))
                for stale in [lp for lp in self._inboxes if lp.is_closed() and lp is not loop]:
                    del self._inboxes[stale]
                self._forget_closed_loops()
        return inbox

    def _forget_closed_loops(self) -> None:
        """(Under `_lock`, as a new loop first takes an event: a new job.) The owners recorded for loops that
        have closed since: a request whose callback came before the request was recorded, a room or a stream
        that never sent its end. Each kept its job's loop, and all it holds, until pushed out."""
        for table in (self._by_async_id, self._by_room, self._by_stream):
            # (a copy first: `put` pops from these without the lock)
            for key in [k for k, lp in list(table.items()) if lp.is_closed()]:
                table.pop(key, None)

    # routing

    def owner(self, item: Any) -> asyncio.AbstractEventLoop | None:
        which = item.WhichOneof("message")
        if which == "audio_stream_event":
            loop = self._by_stream.get(item.audio_stream_event.stream_handle)
            if loop is not None and item.audio_stream_event.HasField("eos"):
                self._by_stream.pop(item.audio_stream_event.stream_handle, None)
            return loop
        if which == "room_event":
            loop = self._by_room.get(item.room_event.room_handle)
            if loop is not None and item.room_event.HasField("eos"):
                self._by_room.pop(item.room_event.room_handle, None)
            return loop
        if which is None or not self._carries_async_id(item, which):
            return None
        # (one dict operation, atomic under the GIL: no lock on the delivery path)
        loop = self._by_async_id.pop(getattr(item, which).async_id, None)
        if loop is not None and which == "connect" and item.connect.HasField("result"):
            self._by_room[item.connect.result.room.handle.id] = loop  # the room's events: its job's loop
        return loop

    def _carries_async_id(self, msg: Any, which: str) -> bool:
        has = self._has_async_id.get(which)
        if has is None:
            field = msg.DESCRIPTOR.fields_by_name[which].message_type
            has = self._has_async_id[which] = field is not None and "async_id" in field.fields_by_name
        return has

    def record_request(self, resp: Any) -> None:
        """Called with each request's response: its callback, if it has one, belongs to the calling loop."""
        which = resp.WhichOneof("message")
        if which is None or not self._carries_async_id(resp, which):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a request made off any loop: its callback goes to everyone
        with self._lock:
            self._by_async_id[getattr(resp, which).async_id] = loop
            while len(self._by_async_id) > ASYNC_IDS_KEPT:
                self._by_async_id.popitem(last=False)

    def record_stream(self, handle: int, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._by_stream[handle] = loop
            if len(self._by_stream) > 4 * ASYNC_IDS_KEPT:  # streams that never sent their end
                for h in [h for h, lp in list(self._by_stream.items()) if lp.is_closed()]:
                    self._by_stream.pop(h, None)
