"""What a caller hears of the agent's audio (agent/audio_out/heard.py): a late frame is a gap only where its
lateness outruns the audio queued ahead of it; otherwise the playout absorbed it. On synthetic frame timings,
then through the playout buffer itself in real time (the page: tests/test_monitor_heard.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from agent.audio_out.heard import LATE_S, HeardCounter
from agent.audio_out.playout_buffer import PlayoutBuffer

pytestmark = pytest.mark.serial  # frames through the playout buffer in real time (tests/conftest.py)

FRAME_S = 0.08
RATE = 8000
FRAME = int(RATE * FRAME_S)


def play(late: list[float], lead: float) -> tuple[HeardCounter, list[bool]]:
    """A turn whose frame k arrives `late[k]` behind the cadence, its first played `lead` after it came, each
    next one when the one before ends or when it comes, whichever is later: the counter's verdicts."""
    heard = HeardCounter()
    start = late[0] + lead
    verdicts = [heard.frame(0.0, None, start)]
    for k in range(1, len(late)):
        due = start + FRAME_S
        start = max(due, k * FRAME_S + late[k])
        verdicts.append(heard.frame(late[k], due, start))
    return heard, verdicts


def test_a_late_frame_is_a_gap_only_where_its_lateness_outruns_the_lead():
    lead = 0.03
    #       on time, within the lead (absorbed x2), past it: a gap of 20 ms, then the play head is 50 ms
    #       behind the cadence, so 40 ms late is absorbed, and 3 ms late is not late at all
    late = [0.0, 0.01, 0.02, 0.05, 0.04, 0.0, 0.003, 0.0]
    heard, verdicts = play(late, lead)
    assert verdicts == [False, False, False, True, False, False, False, False]
    assert (heard.gaps, heard.gap_s, heard.absorbed, heard.late) == (1, pytest.approx(0.02), 3, 4)


@pytest.mark.parametrize("lead", [0.0, 0.01, 0.04, 0.08, 0.16])
def test_random_lateness_counts_match_the_lead(lead):
    """Every frame's verdict against its lateness and the lead the play head had when it came."""
    rng = np.random.default_rng(int(lead * 1000))
    late = [0.0, *rng.exponential(0.03, 400).tolist()]
    heard, verdicts = play(late, lead)
    behind = late[0] + lead  # how far behind the cadence the play head runs: the lead a frame has
    gaps = absorbed = 0
    for k in range(1, len(late)):
        if late[k] > behind + 1e-4:
            gaps += 1
            assert verdicts[k], (k, late[k], behind)
            behind = late[k]
        else:
            assert not verdicts[k], (k, late[k], behind)
            absorbed += late[k] > LATE_S
    assert (heard.gaps, heard.absorbed) == (gaps, absorbed)
    assert heard.late == sum(x > LATE_S for x in late[1:])
    assert gaps > 0 if lead < 0.08 else absorbed > 0  # both kinds are exercised


class Recorder:
    sample_rate = RATE

    async def write(self, samples: np.ndarray, at: float) -> None:
        pass

    def cut(self, at: float) -> None:
        pass

    async def aclose(self) -> None:
        pass


def test_the_playout_counts_absorbed_frames_and_gaps_and_reports_them():
    """A fixed one-frame start delay (80 ms ahead of the ear): a frame 40 ms late plays without a break,
    one 240 ms late leaves a gap of about 160 ms; both reach the engine through the playout's report."""
    reports: list[tuple] = []

    async def main() -> tuple[PlayoutBuffer, list[float]]:
        buf = PlayoutBuffer(Recorder(), FRAME_S)
        buf.fixed()
        buf.report = lambda *a: reports.append(a)
        buf.start()
        buf.begin_segment()
        t0 = time.monotonic()
        behind = []
        for k in range(14):
            due = t0 + k * FRAME_S + {4: 0.04, 9: 0.24}.get(k, 0.0)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            behind.append(time.monotonic() - (t0 + k * FRAME_S))
            await buf.write(np.full(FRAME, 1000, np.int16))
        buf.end_segment()
        await buf.play_out(timeout=2.0)
        await buf.aclose()
        return buf, behind

    buf, behind = asyncio.run(main())
    st = buf.stats
    print([round(x * 1000) for x in behind], st)
    assert st["gaps"] >= 1 and st["gap_s"] >= 0.24 - FRAME_S - 0.03  # frame 9's, whatever else the load did
    assert st["late_absorbed"] >= 1  # frame 4's, 40 ms late against an 80 ms lead
    assert st["late_absorbed"] == buf.heard.absorbed and st["gaps"] == buf.heard.gaps
    if max(behind[:4] + behind[5:9] + behind[10:]) < LATE_S:  # a quiet machine: exactly those two
        assert (st["gaps"], st["late_absorbed"]) == (1, 1)
    _, gaps, gap_s, _, _, absorbed = reports[-1]  # the engine's last word from the playout
    assert (gaps, gap_s, absorbed) == (st["gaps"], st["gap_s"], st["late_absorbed"])


def test_a_measured_call_logs_each_frames_arrival_and_start_for_the_latency_benchmark(caplog):
    """Echo mode keeps each frame's times and logs them at the call's close, where benchmarks/latency/hops.py
    reads them back, through the log's privacy filter (which masks any number of seven digits, as a
    machine's monotonic clock in milliseconds is); a call that keeps nothing logs nothing."""
    from agent.log_privacy import PHONE_DIGITS
    from benchmarks.latency.hops import room_times
    from redaction.names import mask_numbers

    t0 = 13012.3456  # about 3.6 hours after the machine started
    arrived = [t0 + k * FRAME_S + (0.0123 if k == 3 else 0.0) for k in range(5)]
    started = [a + w for a, w in zip(arrived, (0.02, 0.0191, 0.0205, -0.0040, 0.02), strict=True)]
    kept, plain = HeardCounter(), HeardCounter()
    kept.keep_times("room-abc")
    for k in range(5):
        for h in (kept, plain):
            h.frame(0.0, None if k == 0 else started[k - 1] + FRAME_S, started[k], arrived[k])
    with caplog.at_level("INFO", logger="chorus.agent.heard"):
        plain.close()
        assert not caplog.records
        kept.close()
    masked = mask_numbers(caplog.text, PHONE_DIGITS)
    times = room_times(masked)
    assert list(times) == ["room-abc"]
    assert times["room-abc"][:, 0] == pytest.approx(arrived, abs=2e-4)
    assert times["room-abc"][:, 1] == pytest.approx(started, abs=2e-4)
