"""What the playout records as played (`PlayoutBuffer.spans`) when a clip is stopped: the chunk playing ends
where it was cut, and a chunk already handed to the sink (HANDOVER_EARLY_S before its start) but stopped
before that start played nothing (a span of no length at its start, never one that ends before it begins)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from agent.audio_out.playout_buffer import HANDOVER_EARLY_S, PlayoutBuffer

FRAME_S = 0.08
RATE = 8000


class Recorder:
    """A sink that records each chunk's planned start, and where it was cut."""

    sample_rate = RATE

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cuts: list[float] = []

    async def write(self, samples: np.ndarray, at: float) -> None:
        self.starts.append(at)

    def cut(self, at: float) -> None:
        self.cuts.append(at)

    async def aclose(self) -> None:
        pass


def stop_at(offset: float) -> tuple[list[list], Recorder, float]:
    """A clip of six frames, stopped `offset` seconds into its third chunk's start (negative: before it)."""

    async def main():
        buf = PlayoutBuffer(Recorder(), FRAME_S)
        buf.start()
        buf.play_clip(np.full(int(6 * FRAME_S * RATE), 1000, np.int16), "hold")
        while len(buf.sink.starts) < 3:
            await asyncio.sleep(0.001)
        third = buf.sink.starts[2]
        await asyncio.sleep(max(0.0, third + offset - time.monotonic()))
        stopped = time.monotonic()
        buf.stop_clip()
        spans = [list(s) for s in buf.spans]
        await buf.aclose()
        return spans, buf.sink, stopped

    return asyncio.run(main())


def test_a_clip_stopped_before_the_chunk_it_handed_over_starts_plays_none_of_it():
    for _ in range(10):  # a loaded machine's loop may wake past the chunk's start: the next test's case
        spans, sink, stopped = stop_at(-HANDOVER_EARLY_S / 2)
        if stopped < sink.starts[2]:
            break
    else:
        pytest.skip("the loop never woke inside the handover's few milliseconds")
    assert [s[0] for s in spans] == ["clip"] * 3
    assert spans[2][1] == spans[2][2] == sink.starts[2]  # handed over, never played
    assert spans[1][2] == sink.starts[2]  # the chunk before played to its end
    assert all(b >= a for _, a, b in spans)


def test_a_clip_stopped_mid_chunk_ends_where_it_was_cut():
    spans, sink, stopped = stop_at(0.03)
    assert [s[0] for s in spans] == ["clip"] * 3
    assert sink.cuts and spans[2][1] == sink.starts[2] < spans[2][2] == sink.cuts[0]
    assert stopped <= spans[2][2] <= sink.starts[2] + FRAME_S
