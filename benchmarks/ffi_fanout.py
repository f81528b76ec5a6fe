"""What the rtc SDK's event fan-out costs a worker with N rooms, and what routing (agent/audio_in/rtc_ffi.py)
saves.

`python -m benchmarks.ffi_fanout --rooms 8 16 64` runs N event loops in threads, each holding the
subscriptions one job's loop holds (its room's queue, its audio stream's, a request waiter), and puts, at real
pace for `--seconds`, the events a live room produces, at the rates measured on a worker with 8 rooms through
a real LiveKit server (per room and second: 16 capture callbacks, 12.5 received audio frames, 2 room events).
It does so once through the SDK's own FfiQueue and once through RoutedQueue, and reports per N the deliveries
(cross-thread wake-ups) per second and the CPU the process spent, as a share of one core. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from livekit.rtc._ffi_client import FfiQueue
from livekit.rtc._proto import ffi_pb2

from agent.audio_in.rtc_ffi import RoutedQueue

PER_ROOM_PER_S = {"capture": 16.0, "audio": 12.5, "room": 2.0}


class Counting:
    """An asyncio.Queue stand-in that counts what it is given (in its loop's thread)."""

    def __init__(self) -> None:
        self.n = 0

    def put_nowait(self, _item) -> None:
        self.n += 1


def run(kind: str, rooms: int, seconds: float) -> dict:
    q = FfiQueue() if kind == "sdk" else RoutedQueue()
    loops = [asyncio.new_event_loop() for _ in range(rooms)]
    threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
    for t in threads:
        t.start()
    sinks = []
    for i, lp in enumerate(loops):
        for filt in (
            lambda e: e.WhichOneof("message") not in ("audio_stream_event", "video_stream_event"),
            lambda e: e.WhichOneof("message") == "audio_stream_event",
            None,
        ):
            sink = Counting()
            if isinstance(q, RoutedQueue):
                q._add(sink, lp, filt)
            else:
                q._subscribers.append((sink, lp, filt))
            sinks.append(sink)
        if isinstance(q, RoutedQueue):
            q.record_stream(100 + i, lp)
            q._by_room[i] = lp  # as a routed connect callback records it
    period = 1.0 / sum(PER_ROOM_PER_S.values()) / rooms
    kinds = [k for k, r in PER_ROOM_PER_S.items() for _ in range(int(r * 2))]
    t0, c0 = time.monotonic(), time.process_time()
    n, async_id = 0, 10_000
    while time.monotonic() - t0 < seconds:
        room = n % rooms
        kind_n = kinds[(n // rooms) % len(kinds)]
        ev = ffi_pb2.FfiEvent()
        if kind_n == "audio":
            ev.audio_stream_event.stream_handle = 100 + room
            ev.audio_stream_event.frame_received.frame.handle.id = 1
        elif kind_n == "capture":
            async_id += 1
            if isinstance(q, RoutedQueue):
                with q._lock:
                    q._by_async_id[async_id] = loops[room]  # as record_request does on the room's loop
            ev.capture_audio_frame.async_id = async_id
        else:
            ev.room_event.room_handle = room
            ev.room_event.active_speakers_changed.SetInParent()
        q.put(ev)
        n += 1
        lag = t0 + n * period - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    wall = time.monotonic() - t0
    for lp in loops:  # let every loop take what it was given
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), lp).result(30)
    cpu = time.process_time() - c0
    for lp in loops:
        lp.call_soon_threadsafe(lp.stop)
    for t in threads:
        t.join(5)
    delivered = sum(s.n for s in sinks)
    return {
        "events_per_s": round(n / wall, 1),
        "paced": round(n / (wall / period), 3),  # 1.0: the feeder kept up with real time
        "deliveries_per_s": round(delivered / wall, 1),
        "cpu_share_of_one_core": round(cpu / wall, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    out = {"seconds": args.seconds, "per_room_per_s": PER_ROOM_PER_S, "by_rooms": {}}
    for rooms in args.rooms:
        row = {kind: run(kind, rooms, args.seconds) for kind in ("sdk", "routed")}
        out["by_rooms"][str(rooms)] = row
        print(
            f"{rooms:3d} rooms: SDK {row['sdk']['deliveries_per_s']:9.0f} deliveries/s, "
            f"{row['sdk']['cpu_share_of_one_core']:.0%} of a core (paced {row['sdk']['paced']:.2f}); routed "
            f"{row['routed']['deliveries_per_s']:7.0f}/s, {row['routed']['cpu_share_of_one_core']:.0%} "
            f"(paced {row['routed']['paced']:.2f})",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
