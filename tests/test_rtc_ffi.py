"""agent/audio_in/rtc_ffi.py: the rtc SDK's FFI client created once for many job threads, and its events
routed to the loop that owns them, with the SDK's own FfiQueue as the reference for what each subscriber must
receive."""

from __future__ import annotations

import asyncio
import builtins
import gc
import random
import sys
import threading
import traceback
from collections import deque

import pytest
from livekit.rtc._ffi_client import FfiClient, FfiQueue
from livekit.rtc._proto import ffi_pb2

from agent.audio_in import rtc_ffi
from agent.audio_in.rtc_ffi import RoutedQueue


class LoopThread:
    """An event loop running in its own thread, as each job's is."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def drain(self, queue) -> list:
        async def take():
            await asyncio.sleep(0)  # the put_nowait callbacks scheduled before this one have run
            items = []
            while not queue.empty():
                items.append(queue.get_nowait())
            return items

        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loops():
    made = [LoopThread() for _ in range(3)]
    yield made
    for lt in made:
        lt.close()


def audio_event(handle: int) -> ffi_pb2.FfiEvent:
    ev = ffi_pb2.FfiEvent()
    ev.audio_stream_event.stream_handle = handle
    ev.audio_stream_event.frame_received.frame.handle.id = 1
    return ev


def capture_callback(async_id: int) -> ffi_pb2.FfiEvent:
    ev = ffi_pb2.FfiEvent()
    ev.capture_audio_frame.async_id = async_id
    return ev


def capture_response(async_id: int) -> ffi_pb2.FfiResponse:
    resp = ffi_pb2.FfiResponse()
    resp.capture_audio_frame.async_id = async_id
    return resp


def room_event(handle: int) -> ffi_pb2.FfiEvent:
    ev = ffi_pb2.FfiEvent()
    ev.room_event.room_handle = handle
    ev.room_event.eos.SetInParent()
    return ev


def is_audio(e) -> bool:
    return e.WhichOneof("message") == "audio_stream_event"


def not_media(e) -> bool:
    return e.WhichOneof("message") not in ("audio_stream_event", "video_stream_event")


def subscribe_like_a_room(q, lt: LoopThread) -> dict:
    """The subscriptions one job's loop holds: its room's queue, its audio stream's, and a request waiter."""
    return {
        "room": lt.call(q.subscribe, lt.loop, not_media),
        "audio": lt.call(q.subscribe, lt.loop, is_audio),
        "waiter": lt.call(q.subscribe),
    }


def test_an_audio_stream_event_reaches_only_the_loop_that_owns_the_stream(loops):
    q = RoutedQueue()
    subs = [subscribe_like_a_room(q, lt) for lt in loops]
    for i, lt in enumerate(loops):
        q.record_stream(100 + i, lt.loop)
    q.put(audio_event(101))
    got = [{k: len(lt.drain(s[k])) for k in s} for lt, s in zip(loops, subs, strict=True)]
    assert got == [
        {"room": 0, "audio": 0, "waiter": 0},
        {"room": 0, "audio": 1, "waiter": 1},
        {"room": 0, "audio": 0, "waiter": 0},
    ]
    q.put(audio_event(999))  # a stream not recorded (yet): everyone, as the SDK does
    assert [len(lt.drain(s["audio"])) for lt, s in zip(loops, subs, strict=True)] == [1, 1, 1]


def test_a_callback_reaches_only_the_loop_that_made_the_request(loops):
    q = RoutedQueue()
    subs = [subscribe_like_a_room(q, lt) for lt in loops]
    loops[2].call(q.record_request, capture_response(7))  # the request is made on the third job's loop
    q.put(capture_callback(7))
    assert [len(lt.drain(s["waiter"])) for lt, s in zip(loops, subs, strict=True)] == [0, 0, 1]
    assert [len(lt.drain(s["room"])) for lt, s in zip(loops, subs, strict=True)] == [0, 0, 1]
    q.put(capture_callback(7))  # its owner is forgotten once delivered: a second one goes to everyone
    assert [len(lt.drain(s["waiter"])) for lt, s in zip(loops, subs, strict=True)] == [1, 1, 1]
    q.record_request(capture_response(8))  # made off any loop: not routed
    q.put(capture_callback(8))
    assert [len(lt.drain(s["waiter"])) for lt, s in zip(loops, subs, strict=True)] == [1, 1, 1]


def test_room_events_still_reach_every_room_and_a_closed_loops_subscriber_is_dropped(loops):
    q = RoutedQueue()
    subs = [subscribe_like_a_room(q, lt) for lt in loops]
    q.put(room_event(5))
    assert [len(lt.drain(s["room"])) for lt, s in zip(loops, subs, strict=True)] == [1, 1, 1]
    loops[0].close()
    loops[0] = LoopThread()  # the fixture closes the replacement
    q.put(room_event(5))
    q.put(audio_event(999))
    assert q.subscriber_count == 6  # the closed loop's three are gone once an event reached each...
    for lt, s in zip(loops[1:], subs[1:], strict=True):  # ... and the others still get theirs
        assert [len(lt.drain(s[k])) for k in ("room", "audio", "waiter")] == [
            1,
            1,
            3,
        ]  # (its first room event too)


def test_every_delivery_the_owner_needs_is_made_and_no_other_loop_is_woken(loops):
    """A random stream of audio frames, capture callbacks and room events, put to the SDK's FfiQueue and to
    RoutedQueue with the same subscribers: every event reaches its owning loop's subscribers exactly as the
    SDK delivers it there, and a routed event wakes no other loop."""
    sdk, routed = FfiQueue(), RoutedQueue()
    rng = random.Random(7)
    subs = {"sdk": [subscribe_like_a_room(sdk, lt) for lt in loops]}
    subs["routed"] = [subscribe_like_a_room(routed, lt) for lt in loops]
    for i, lt in enumerate(loops):
        routed.record_stream(100 + i, lt.loop)
    owners: dict[int, int] = {}
    events = []
    for n in range(300):
        kind = rng.choice(["audio", "capture", "room"])
        if kind == "audio":
            owner = rng.randrange(3)
            events.append((audio_event(100 + owner), owner))
        elif kind == "capture":
            owner = rng.randrange(3)
            owners[n] = owner
            loops[owner].call(routed.record_request, capture_response(1000 + n))
            events.append((capture_callback(1000 + n), owner))
        else:
            events.append((room_event(1), None))
    for ev, _ in events:
        sdk.put(ev)
        routed.put(ev)
    got = {
        name: [{k: lt.drain(s[k]) for k in s} for lt, s in zip(loops, subs[name], strict=True)]
        for name in subs
    }
    for i in range(3):
        for k in ("room", "audio", "waiter"):
            mine = [ev for ev, owner in events if owner in (i, None)]
            expected = [ev for ev in got["sdk"][i][k] if any(ev is m for m in mine)]
            assert [id(e) for e in got["routed"][i][k]] == [id(e) for e in expected], (i, k)
    sdk_total = sum(len(v) for s in got["sdk"] for v in s.values())
    routed_total = sum(len(v) for s in got["routed"] for v in s.values())
    broadcast = sum(owner is None for _, owner in events)
    assert sdk_total == 6 * len(events)  # every event: two of the three subscriptions on each of 3 loops
    assert routed_total == 2 * (len(events) - broadcast) + 6 * broadcast  # a routed one: its owner's two


def test_install_is_safe_from_many_threads_at_once():
    results, barrier = [], threading.Barrier(8)

    def run():
        barrier.wait()
        results.append((rtc_ffi.install(), id(FfiClient.instance), id(FfiClient.instance.queue)))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 8 and len(set(results)) == 1, results
    assert results[0][0] is True
    assert isinstance(FfiClient.instance.queue, RoutedQueue)


def test_a_rooms_events_reach_the_loop_that_connected_it_once_its_connect_callback_came(loops):
    q = RoutedQueue()
    subs = [subscribe_like_a_room(q, lt) for lt in loops]
    resp = ffi_pb2.FfiResponse()
    resp.connect.async_id = 41
    loops[1].call(q.record_request, resp)
    cb = ffi_pb2.FfiEvent()
    cb.connect.async_id = 41
    cb.connect.result.room.handle.id = 9
    q.put(cb)
    ev = ffi_pb2.FfiEvent()
    ev.room_event.room_handle = 9
    ev.room_event.active_speakers_changed.SetInParent()
    q.put(ev)
    q.put(room_event(9))  # the room's end: delivered to its loop, and the room forgotten
    q.put(ev)
    got = [len(lt.drain(s["room"])) for lt, s in zip(loops, subs, strict=True)]
    assert got == [1, 4, 1]  # the callback, two room events and the end; then everyone gets a stray event


def test_an_ended_jobs_loop_is_let_go_once_a_new_job_takes_its_first_event(loops):
    # a request whose callback came before it was recorded (its owner never popped), and a room that never
    # sent its end: each kept its job's closed loop, and all that loop still held, for the process's life
    q = RoutedQueue()
    ended = loops[0]
    ended.call(q.record_request, capture_response(41))
    q.record_stream(7, ended.loop)
    ended.call(q.subscribe, ended.loop, not_media)
    q.put(audio_event(7))  # the ended job's inbox: its loop is known to the queue
    ended.close()
    loops[0] = LoopThread()  # the fixture closes the replacement
    live = loops[1]
    live.call(q.record_request, capture_response(42))
    assert {id(lp) for lp in q._by_async_id.values()} == {id(ended.loop), id(live.loop)}
    sub = live.call(q.subscribe, live.loop, is_audio)
    q.record_stream(8, live.loop)
    q.put(audio_event(8))  # the new job's first event
    assert len(live.drain(sub)) == 1
    assert list(q._by_async_id.values()) == [live.loop] and list(q._by_stream.values()) == [live.loop]
    q.put(capture_callback(42))  # the live job's request still finds its owner
    assert q._by_async_id == {}


class DeadRoom:
    """As `rtc.Room`: its finalizer unsubscribes its queue. It waits, dead, in a reference cycle, so only a
    collection runs that finalizer, on whichever thread the collection happens to start."""

    def __init__(self, q: RoutedQueue, queue) -> None:
        self.q, self.queue, self.cycle = q, queue, self

    def __del__(self) -> None:
        self.q.unsubscribe(self.queue)


def bounded(fn, timeout: float = 20.0):
    """`fn()` in a thread of its own: a call that deadlocks fails, with its stack, instead of hanging the
    suite (the thread is left behind, a daemon, stuck on a queue no other test uses)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (raised again below, on the test's thread)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        frame = sys._current_frames().get(t.ident)
        stack = "".join(traceback.format_stack(frame))
        pytest.fail(f"still running after {timeout:g} s, deadlocked:\n{stack}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_dead_room_collected_while_a_frame_unsubscribes_neither_hangs_nor_loses_a_subscriber(
    loops, monkeypatch
):
    # the soak's hang: `capture_frame`'s unsubscribe building its new tuples under the lock, a collection
    # there finalizing dead rooms, whose own unsubscribe then waited on the lock its thread already held
    lt = loops[0]
    q = RoutedQueue()
    keep = lt.call(q.subscribe, lt.loop, not_media)
    dead = [lt.call(q.subscribe, lt.loop, not_media) for _ in range(3)]
    frame = lt.call(q.subscribe)
    armed, collections = [True], []

    def collecting_tuple(items=()):
        if armed:  # once: the collection lands inside the update, with the dead rooms in it
            armed.clear()
            collections.append(gc.collect())
        return builtins.tuple(items)

    gc.disable()  # the rooms wait for the collection forced below, not an earlier one
    try:
        for queue in dead:
            DeadRoom(q, queue)  # dropped at once: garbage in a cycle
        monkeypatch.setattr(rtc_ffi, "tuple", collecting_tuple, raising=False)
        bounded(lambda: q.unsubscribe(frame))
    finally:
        gc.enable()
    assert collections and collections[0] >= 3  # the rooms were collected inside the update
    assert [s[0] for s in q._subscribers] == [keep]  # the frame's and the rooms' gone, none resurrected
    assert [s[0] for s in q._of_loop[lt.loop]] == [keep]
    q.put(room_event(5))
    assert len(lt.drain(keep)) == 1 and not any(lt.drain(x) for x in [*dead, frame])


def test_finalizers_run_by_collections_anywhere_in_the_routers_updates_hang_nothing_and_lose_nothing(loops):
    """Collections as often as the collector can make them (a threshold of one allocation), each running a
    finalizer that unsubscribes a dead room's queue, while a job subscribes and unsubscribes per frame as
    `capture_frame` does and events come to a loop that closed: every update finishes, and what is left
    subscribed is exactly what should be."""
    lt = loops[0]
    q = RoutedQueue()
    keep = lt.call(q.subscribe, lt.loop, not_media)
    dying = deque(q.subscribe(lt.loop, not_media) for _ in range(600))  # the rooms that will die
    finalized = []

    def finalizer(phase, info):
        if phase == "start" and dying:
            queue = dying.popleft()
            q.unsubscribe(queue)
            finalized.append(queue)

    def frames():
        for n in range(300):
            frame = q.subscribe(lt.loop)
            q.unsubscribe(frame)
            if n % 50 == 0:  # a job's loop that closed without unsubscribing: dropped by `put`
                q.subscribe(loops[1].loop)
                loops[1].close()
                q.put(room_event(5))
                loops[1] = LoopThread()  # (the fixture closes the last one)

    threshold = gc.get_threshold()
    gc.callbacks.append(finalizer)
    gc.set_threshold(1)
    try:
        bounded(frames)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(finalizer)
    assert len(finalized) > 50  # collections came, inside the updates among them
    for queue in dying:  # the rooms the collector did not get to
        q.unsubscribe(queue)
    assert [s[0] for s in q._subscribers] == [keep]
    assert list(q._of_loop) == [lt.loop] and [s[0] for s in q._of_loop[lt.loop]] == [keep]
