"""What WebRTC's receive side holds of a call's audio: the jitter buffer (libwebrtc's NetEQ) in front of an
inbound audio track, read from the rtc runtime's stats (`rtc.Room.get_rtc_stats`).

NetEQ sizes its buffer from the packets' arrivals, as the playout does from the model's frames; the two
together are what a caller's audio waits for before the model hears it. Its counters are cumulative over the
call; `window` turns two readings into the means between them. Used by the worker for each call's inbound
track (`ReceiveWatch`: the snapshot's `rx_jitter_ms`) and by the latency benchmark for each caller's. Knows
the rtc SDK's stats messages; nothing of the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("chorus.receive")

DECODER_RATE = 48_000  # the counts are the decoder's samples: Opus decodes at 48 kHz
COUNTERS = (
    "jitter_buffer_delay",
    "jitter_buffer_target_delay",
    "jitter_buffer_minimum_delay",
    "jitter_buffer_emitted_count",
    "concealed_samples",
    "inserted_samples_for_deceleration",
    "removed_samples_for_acceleration",
)
READ_EVERY_S = 5.0  # a call's receive side is read this often (one request and its answer a room)


def inbound_audio(stats: list[Any]) -> dict[str, float]:
    """The cumulative counters of the first inbound audio stream in a list of `RtcStats` (a call's room
    carries one: the caller's), with the RTP interarrival jitter (seconds); {} if there is none."""
    for s in stats:
        if s.WhichOneof("stats") == "inbound_rtp" and s.inbound_rtp.stream.kind == "audio":
            got = {k: float(getattr(s.inbound_rtp.inbound, k)) for k in COUNTERS}
            got["jitter"] = float(s.inbound_rtp.received.jitter)
            return got
    return {}


def every_stat(stats: Any) -> list[Any]:
    """The stats of both of a room's peer connections (`rtc.RtcStats`): with one connection for both ways
    (the server's single peer connection) the inbound streams are among the publisher's."""
    return [*stats.subscriber_stats, *stats.publisher_stats]


def window(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Between two readings of `inbound_audio` (`a` {}: since the stream began): the jitter buffer's mean
    delay, target and minimum (ms), the audio it concealed (lost or late packets), inserted to slow down and
    removed to catch up (ms), and the RTP jitter at the second reading (ms); {} when nothing was played
    between them."""
    if not b:
        return {}
    d = {k: b[k] - a.get(k, 0.0) for k in COUNTERS}
    n = d["jitter_buffer_emitted_count"]
    if n <= 0:
        return {}
    per_ms = DECODER_RATE / 1e3
    return {
        "delay_ms": round(d["jitter_buffer_delay"] / n * 1e3, 1),
        "target_ms": round(d["jitter_buffer_target_delay"] / n * 1e3, 1),
        "minimum_ms": round(d["jitter_buffer_minimum_delay"] / n * 1e3, 1),
        "concealed_ms": round(d["concealed_samples"] / per_ms, 1),
        "inserted_ms": round(d["inserted_samples_for_deceleration"] / per_ms, 1),
        "removed_ms": round(d["removed_samples_for_acceleration"] / per_ms, 1),
        "rtp_jitter_ms": round(b.get("jitter", 0.0) * 1e3, 1),
    }


@dataclass
class ReceiveWatch:
    """Reads a room's inbound audio every `every_s` and reports the last window's mean jitter-buffer delay and
    the audio concealed so far this call (seconds) to `report` (`SessionHandle.report_receive`). A failed
    reading is skipped; the call never waits on it."""

    room: Any  # rtc.Room
    report: Callable[[float, float], None]
    every_s: float = READ_EVERY_S

    async def run(self) -> None:
        last: dict[str, float] = {}
        while True:
            await asyncio.sleep(self.every_s)
            if not self.room.isconnected():
                continue
            try:
                stats = await asyncio.wait_for(self.room.get_rtc_stats(), self.every_s)
            except Exception as e:  # noqa: BLE001 (a figure missed; the call goes on whatever the runtime says)
                log.debug("the room's receive stats were not read: %s", type(e).__name__)
                continue
            now = inbound_audio(every_stat(stats))
            w = window(last, now)
            if now:
                last = now
            if w:  # a closed session's handle takes it and keeps it to itself
                self.report(w["delay_ms"] / 1e3, now["concealed_samples"] / DECODER_RATE)
