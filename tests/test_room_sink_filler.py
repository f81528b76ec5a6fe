"""The agent's track between turns carries 1 s frames of silence (agent/audio_out/sinks.py, `RoomSink`), and a
turn's first words clear what is still queued of it. With the captures made natively
(agent/audio_in/audio_pump.py, `TrackCapture`) a capture returns before the rtc runtime has queued its
samples: a filler frame still on its way when the words clear the queue lands after the clear, and every
word of the rest of the call is heard a second late behind it. The words wait for it to be taken, then
clear."""

from __future__ import annotations

import asyncio

import numpy as np

from agent.audio_in.audio_pump import TrackCapture
from agent.audio_out.sinks import ROOM_RATE, RoomSink


class RuntimeDouble(TrackCapture):
    """The native captures as the rtc runtime answers them: each capture queued `delay_s` after it was made.
    `events` is what reached the source's queue, in order: a capture's samples or a clear."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.closed, self.rate = delay_s, False, ROOM_RATE
        self.events: list[str] = []
        self.sent = self.done = 0

    def capture(self, samples: np.ndarray) -> bool:
        self.sent += 1
        what = "silence" if not samples.any() else "speech"
        asyncio.get_running_loop().call_later(self.delay_s, self._taken, what)
        return True

    def _taken(self, what: str) -> None:
        self.events.append(what)
        self.done += 1

    def stats(self) -> dict[str, float]:
        return {"sent": self.sent, "done": self.done, "errors": 0.0, "slow": 0.0, "refused": 0.0}

    def close(self) -> None:
        self.closed = True


class SourceDouble:
    def __init__(self, runtime: RuntimeDouble) -> None:
        self.runtime = runtime

    def clear_queue(self) -> None:
        self.runtime.events.append("clear")


def test_a_turns_first_words_clear_the_fillers_silence_only_once_the_runtime_has_queued_it():
    async def main() -> tuple[list[str], int]:
        sink = RoomSink()
        real = sink.source
        runtime = RuntimeDouble(delay_s=0.02)
        sink._native, sink.source = runtime, SourceDouble(runtime)
        try:
            await sink._capture(np.zeros(ROOM_RATE, np.int16), silence=True)  # the filler, between turns
            await sink.write(np.full(ROOM_RATE // 10, 1000, np.int16), 0.0)  # the turn's first words at once
            await asyncio.sleep(0.1)
            return runtime.events, sink.stalls
        finally:
            await real.aclose()

    events, stalls = asyncio.run(main())
    # the silence queued, then cleared, then the words: nothing ahead of them
    assert events == ["silence", "clear", "speech"], events
    assert stalls == 0


def test_a_runtime_that_never_takes_the_filler_costs_the_words_at_most_the_settle_time_and_is_counted():
    async def main() -> tuple[list[str], int, float]:
        sink = RoomSink()
        real = sink.source
        runtime = RuntimeDouble(delay_s=10.0)  # answered long after
        sink._native, sink.source = runtime, SourceDouble(runtime)
        try:
            await sink._capture(np.zeros(ROOM_RATE, np.int16), silence=True)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await sink.write(np.full(ROOM_RATE // 10, 1000, np.int16), 0.0)
            return list(runtime.events), sink.stalls, loop.time() - t0
        finally:
            await real.aclose()

    events, stalls, waited = asyncio.run(main())
    assert events == ["clear"]  # cleared all the same once the settle time ran out
    assert stalls == 1
    assert RoomSink.SETTLE_S <= waited < RoomSink.SETTLE_S + 1.0
