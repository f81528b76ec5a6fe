"""The receive side's figures (agent/audio_in/receive_stats.py): the rtc runtime's stats messages, as the SDK
returns them, read into the jitter buffer's means over a window, and a room's readings reported every few
seconds."""

from __future__ import annotations

import asyncio

import pytest
from livekit.rtc._proto import stats_pb2

from agent.audio_in.receive_stats import DECODER_RATE, ReceiveWatch, inbound_audio, window


def inbound(kind: str = "audio", **counters: float) -> stats_pb2.RtcStats:
    s = stats_pb2.RtcStats()
    s.inbound_rtp.stream.kind = kind
    s.inbound_rtp.received.jitter = counters.pop("jitter", 0.0)
    for k, v in counters.items():
        setattr(s.inbound_rtp.inbound, k, v)
    return s


def outbound() -> stats_pb2.RtcStats:
    s = stats_pb2.RtcStats()
    s.outbound_rtp.stream.kind = "audio"
    return s


def reading(emitted: int, delay_s: float, concealed: int = 0, jitter: float = 0.0) -> stats_pb2.RtcStats:
    """An audio stream that emitted `emitted` samples, each after `delay_s` in the jitter buffer."""
    return inbound(
        jitter_buffer_emitted_count=emitted,
        jitter_buffer_delay=emitted * delay_s,
        jitter_buffer_target_delay=emitted * delay_s * 0.8,
        jitter_buffer_minimum_delay=emitted * 0.02,
        concealed_samples=concealed,
        jitter=jitter,
    )


def test_the_first_inbound_audio_stream_is_read_and_others_are_passed_over():
    stats = [outbound(), inbound("video", jitter_buffer_emitted_count=9), reading(480, 0.04, jitter=0.003)]
    got = inbound_audio(stats)
    assert got["jitter_buffer_emitted_count"] == 480 and got["jitter_buffer_delay"] == pytest.approx(19.2)
    assert got["jitter"] == pytest.approx(0.003)
    assert inbound_audio([outbound()]) == {} and inbound_audio([]) == {}


def test_a_window_gives_the_means_between_two_readings_not_since_the_call_began():
    # 10 s at 48 kHz with 40 ms of delay, then 5 s more with 100 ms: the window sees only the 100 ms
    a = inbound_audio([reading(480_000, 0.04, concealed=960)])
    b = inbound_audio([reading(480_000, 0.04, concealed=960)])
    more = 240_000
    for k, v in (("jitter_buffer_emitted_count", more), ("jitter_buffer_delay", more * 0.1)):
        b[k] += v
    b["jitter_buffer_target_delay"] += more * 0.08
    b["jitter_buffer_minimum_delay"] += more * 0.02
    b["concealed_samples"] += 4_800
    w = window(a, b)
    assert (w["delay_ms"], w["target_ms"], w["minimum_ms"]) == (100.0, 80.0, 20.0)
    assert w["concealed_ms"] == 4_800 / DECODER_RATE * 1e3 == 100.0
    # from no earlier reading: since the stream began
    assert window({}, a)["delay_ms"] == 40.0 and window({}, a)["concealed_ms"] == 20.0
    # nothing played between them, or nothing read: no figures
    assert window(a, a) == {} and window(a, {}) == {}


class Room:
    """A room whose stats are the readings given, one a request; a reading that is an exception is raised."""

    def __init__(self, readings: list) -> None:
        self.readings, self.requests = readings, 0

    def isconnected(self) -> bool:
        return True

    async def get_rtc_stats(self):
        self.requests += 1
        got = self.readings.pop(0) if self.readings else RuntimeError("the room isn't connected")
        if isinstance(got, Exception):
            raise got
        # alternately among the subscriber's and the publisher's (one peer connection for both ways)
        mine = {"subscriber_stats": got, "publisher_stats": []}
        if self.requests % 2:
            mine = {"subscriber_stats": [], "publisher_stats": got}
        return type("RtcStats", (), mine)()


def test_a_room_is_read_every_few_seconds_and_a_failed_reading_is_skipped():
    readings = [
        [reading(48_000, 0.05)],
        RuntimeError("the room isn't connected"),
        ValueError("an answer the SDK could not parse"),
        [reading(96_000, 0.05 * 0.5 + 0.03 * 0.5, concealed=480)],
        [outbound()],  # the caller's track not subscribed (yet, or any more): nothing to say
    ]
    reports: list[tuple[float, float]] = []
    room = Room(readings)

    async def main() -> None:
        task = asyncio.create_task(ReceiveWatch(room, lambda *r: reports.append(r), every_s=0.01).run())
        while room.requests < 6:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    # the first reading: the mean since the stream began; two failed; the next, the window since the first
    # (48,000 samples at 30 ms); no inbound audio, no report
    assert [(round(d, 4), round(c, 4)) for d, c in reports] == [(0.05, 0.0), (0.03, 0.01)]
