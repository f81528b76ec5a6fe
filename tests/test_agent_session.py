"""Offline `AgentSession`s on the real engine (tiny preset, dummy weights): caller audio in, agent audio out,
tool calls run by the framework against a real SQLite hotel, acknowledgement clips, barge-in, bad input.

Dummy weights decide nothing, so turns and tool calls are made by teacher forcing: the text channel is forced
with start-of-turn ... end-of-turn, the function channel with the real token sequence of a tool call, and both
are held at padding in between (which turns the weights would start depends on when each caller frame was
heard, and a loaded machine changes that).
"""

from __future__ import annotations

import asyncio
import json
import threading
import wave

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import get_job_context, io
from livekit.agents.testing import fake_job_context

from agent.audio_out.acks import AckClips
from agent.audio_out.playout_buffer import BUFFER_FRAMES, HANDOVER_EARLY_S
from agent.audio_out.sinks import ROOM_RATE, WavSink
from agent.call import PcmInput, start_call
from agent.duplex import ChorusModel, InputConverter
from agent.forcing import AFTER_TOOL, Forcing
from agent.hotel import HotelAgent
from engine.config.presets import load_preset
from engine.tick.engine import Engine
from engine_support import ticks_pass
from hotel_support import TODAY, booking
from wait_support import await_until

CLOCK = load_preset("tiny").clock  # the engine's frame clock (the engine below runs the tiny preset)
FRAME_S = CLOCK.frame_ms / 1000
IN_RATE, IN_FRAME = CLOCK.input_rate, CLOCK.input_samples
OUT_RATE, OUT_FRAME = CLOCK.output_rate, CLOCK.output_samples
BUFFER_S = BUFFER_FRAMES * FRAME_S  # the playout buffer
TIMEOUT_S = 90.0  # generous: the machine is shared; waits end on events, never on elapsed time


@pytest.fixture(scope="module")
def engine():
    # calls, not admission, are tested here: a slow shared machine must not turn them away
    # (tests/test_overload.py tests the refusal)
    e = Engine(preset="tiny", num_slots=8, refuse_when_overloaded=False)
    yield e
    e.close()


@pytest.fixture
def hotel(sqlite_hotel):
    return sqlite_hotel  # tests/conftest.py


def loud(seconds: float, rate: int = IN_RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def turn(engine: Engine, text: str, end: bool = True) -> list[int]:
    tok = engine.tokens
    return [tok.bos, *tok.encode(text), *([tok.eos] if end else [])]


async def start_live(engine: Engine, hotel, tmp_path, inp: PcmInput, *, padded: bool = False):
    """A call with the hotel's agent hearing `inp`, its audio written to out.wav, and its session; `padded`:
    padded between forced turns (no turn or call of the dummy weights' own), and live."""
    call = await start_call(
        engine, HotelAgent(hotel), sink=WavSink(tmp_path / "out.wav", OUT_RATE), audio_input=inp
    )
    handle = await call.wait_open()
    if padded:
        handle.pad_between(True)
        await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
    return call, handle


def overlaps(a: list, b: list) -> bool:
    return a[1] < b[2] - 1e-6 and b[1] < a[2] - 1e-6


def test_input_converter_any_rate_and_channels_to_the_engines_mono_frames():
    for rate, channels, ms in ((48_000, 2, 10), (8_000, 1, 20), (IN_RATE, 1, 50), (44_100, 1, 10)):
        conv = InputConverter(IN_RATE, IN_FRAME)
        n = rate * ms // 1000
        chunks = []
        for _ in range(2000 // ms):  # two seconds
            pcm = np.full(n * channels, 1000, np.int16)
            chunks += conv.push(rtc.AudioFrame(pcm.tobytes(), rate, channels, n))
        got = sum(c.size for c in chunks)
        print(rate, channels, "->", len(chunks), "chunks,", got, "samples")
        assert all(c.dtype == np.int16 and c.shape == (IN_FRAME,) for c in chunks)
        assert 2 * IN_RATE - 2 * IN_FRAME <= got <= 2 * IN_RATE  # the resampler may hold a few ms back
        assert abs(int(np.median(np.concatenate(chunks))) - 1000) < 50  # stereo is averaged, not summed
    conv = InputConverter(IN_RATE, IN_FRAME)
    assert conv.push(rtc.AudioFrame(b"", 48_000, 2, 0)) == []


def test_audio_in_engine_audio_out_of_the_turns_duration(engine, hotel, tmp_path):
    """A forced turn of K text positions plays exactly K frames of agent audio (80 ms each), at the end of
    a 160 ms playout buffer, into the room's WAV; before and after it the WAV is silent. (The call's first
    turn starts a frame late, before the jitter is measured; once it is, what waits beyond it is cut from the
    turn's quietest stretches: `trimmed_s`.)"""

    async def main():
        inp = PcmInput(CLOCK)
        with fake_job_context():
            call, handle = await start_live(engine, hotel, tmp_path, inp)
            handle.pad_between(True)  # no turn or call of the dummy weights' own
            inp.push(loud(1.0) // 4)
            await await_until(lambda: call.duplex.stats["frames_out"] >= 5, "the session to go live")
            ids = turn(engine, " Good evening, how can I help you today?")
            handle.force_text(ids)
            await await_until(lambda: call.duplex.stats["speech_frames"] >= len(ids), "the forced turn")
            await await_until(
                lambda: call.output.stats["segments"] == 1 and call.output.queued_s == 0, "playout"
            )
            await ticks_pass(engine)  # nothing more of the turn on its way
            row = next(s for s in engine.snapshot().sessions if s.id == handle.id)
            stats, out = dict(call.duplex.stats), dict(call.output.stats)
            await call.aclose()
            return len(ids), stats, out, row

    k, stats, out, row = asyncio.run(main())
    frames_in = row.frames_in
    # the turn's start as the engine sees it: its tick to its first sample at the sink (the playout's start
    # delay, a frame at the call's start, and the way through the framework)
    assert row.turn_start_ms is not None and 0 < row.turn_start_ms < 500, row
    print(stats, out, "frames in", frames_in)
    assert stats["turns"] == 1 and stats["speech_frames"] == k
    assert out["model_s"] + out["trimmed_s"] == pytest.approx(k * FRAME_S, abs=1e-3)
    played = round((k * FRAME_S - out["trimmed_s"]) * OUT_RATE)
    assert frames_in >= 12  # the caller's second of audio reached the engine as 80 ms frames
    with wave.open(str(tmp_path / "out.wav"), "rb") as w:
        assert w.getframerate() == OUT_RATE
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    voiced = np.flatnonzero(pcm)
    print("wav", pcm.size / OUT_RATE, "s; voiced", voiced.size / OUT_RATE, "s")
    assert voiced.size == pytest.approx(played, rel=0.02)  # only the turn is heard
    # in one piece, save for the gaps the playout reports (a tick later than the playout buffer absorbs)
    span = voiced[-1] - voiced[0] + 1
    assert span == pytest.approx(played + out["gap_s"] * OUT_RATE, abs=OUT_FRAME // 4)


def test_forced_tool_call_runs_the_real_tool_with_a_clip_during_the_pause(engine, hotel, tmp_path):
    """Teacher forcing: the function channel is forced with `book_room`'s real token sequence while the model
    is mid-turn. The call cuts the turn, the framework runs the real `@function_tool` (a row in the database),
    the output is prefilled, the model speaks again (a forced reply); a clip fills the pause only."""

    async def main():
        inp = PcmInput(CLOCK)
        with fake_job_context():
            call, handle = await start_live(engine, hotel, tmp_path, inp, padded=True)
            tok = engine.tokens
            handle.force_text(turn(engine, " Let me book that room for you right", end=False))
            args = booking(guest_name="Grace Hopper")
            handle.force_function([tok.pad] * 5 + tok.call_ids([{"name": "book_room", "arguments": args}]))
            await await_until(lambda: call.duplex.paused, "the pause")
            queued_at_most = call.output.buffer.buffer_s  # what the playout held when the call cut the turn
            handle.force_text(turn(engine, " You are all set."))  # consumed once the session is live again
            await await_until(lambda: call.duplex.stats["resumes"] == 1, "the result to be consumed")
            await await_until(
                lambda: call.duplex.stats["turns"] == 2 and not call.duplex.speaking, "the reply"
            )
            await await_until(lambda: call.output.queued_s == 0 and not call.output.clip_playing, "playout")
            items = [
                (i.type, getattr(i, "name", None), getattr(i, "output", None))
                for i in call.session.history.items
            ]
            result = (
                dict(call.duplex.stats),
                dict(call.output.stats),
                list(call.output.events),
                call.output.spans,
                items,
                queued_at_most,
            )
            await call.aclose()
            return result

    stats, out, events, spans, items, queued_at_most = asyncio.run(main())
    t0 = spans[0][1] if spans else 0
    print(
        stats,
        out,
        [(round(t - t0, 3), e) for t, e in events],
        [(k, round(a - t0, 3), round(b - t0, 3)) for k, a, b in spans],
    )
    assert stats["function_calls"] == 1 and stats["tool_results"] == 1 and stats["resumes"] == 1
    calls = [i for i in items if i[0] == "function_call"]
    outputs = [i for i in items if i[0] == "function_call_output"]
    assert [c[1] for c in calls] == ["book_room"] and len(outputs) == 1
    code = json.loads(outputs[0][2])["confirmation_code"]
    rows = hotel.reservations()
    assert [(r.code, r.guest_name, r.status) for r in rows] == [(code, "Grace Hopper", "confirmed")]

    t_pause = next(t for t, what in events if what == "pause")
    t_resume = next(t for t, what in events if what == "resume")
    model = [s for s in spans if s[0] == "model"]
    clips = [s for s in spans if s[0] == "clip" and s[2] > s[1]]
    assert clips, "an acknowledgement clip played"
    # during the pause, not after it: a clip chunk is handed to the sink HANDOVER_EARLY_S before its start, so
    # the resume may come while the chunk before it plays its last few milliseconds (the one handed over is
    # cut whole: a span of no length)
    assert all(t_pause <= c[1] and c[2] <= t_resume + HANDOVER_EARLY_S + 1e-3 for c in clips)
    assert not any(overlaps(c, m) for c in clips for m in model)  # never over the model's speech
    assert any(m[1] >= t_resume for m in model)  # the model spoke again after the result
    # the turn the call cut short plays out, except (when the framework's function-call handling interrupts
    # the generation before its last frames arrive) at most the playout buffer's worth of it (as deep as the
    # measured jitter made it then, two frames or more)
    lost = stats["speech_frames"] * FRAME_S - out["model_s"] - out["trimmed_s"]  # trimmed: played sooner
    assert queued_at_most >= BUFFER_S
    assert -1e-3 <= lost <= queued_at_most + 1e-3, lost
    assert out["gaps"] == 0 or out["gap_s"] < 0.5  # the clip never lands inside the model's turn


def test_a_scripted_reply_follows_a_tool_pause_that_ended_between_two_polls(engine, hotel, tmp_path):
    """Teacher forcing (a scripted `check_availability` call): a script that polls the session less often than
    a fast tool pauses it still sees that its call paused the session, and its reply is then spoken."""

    async def main():
        await await_until(lambda: engine.occupancy == 0, "the earlier tests' slots to be freed")
        with fake_job_context():
            call = await start_call(engine, HotelAgent(hotel), sink=WavSink(tmp_path / "out.wav", OUT_RATE))
            handle = await call.wait_open()
            await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
            force = Forcing(handle, engine.tokens, call.duplex)
            args = {"check_in": TODAY.isoformat(), "nights": 2, "guests": 2}
            force.call(engine.tokens.call_ids([{"name": "check_availability", "arguments": args}]))
            before = force.call_paused()
            await await_until(lambda: call.duplex.stats["resumes"] == 1, "the pause to be over")
            after = (call.duplex.paused, force.call_paused())
            turns = call.duplex.stats["turns"]
            force.say(AFTER_TOOL)
            await await_until(lambda: call.duplex.stats["turns"] == turns + 1, "the reply")
            await call.aclose()
            return before, after

    before, after = asyncio.run(main())
    assert before is False  # nothing has paused yet
    assert after == (False, True)  # the pause is over, and still counted as the call's


def test_acknowledgement_clips_never_repeat_back_to_back():
    acks = AckClips(OUT_RATE, seed=7)
    names = [acks.next()[0] for _ in range(40)]
    assert len(set(names)) >= 3
    assert all(a != b for a, b in zip(names, names[1:]))
    assert all(0.5 < pcm.size / OUT_RATE < 2.5 for _, pcm in acks.clips)


def test_barge_in_flushes_the_queued_audio(engine, hotel, tmp_path):
    """The caller talks over the model and the model ends its turn mid-sentence (forced end-of-turn): the
    audio still queued is dropped at once instead of played."""

    async def main():
        inp = PcmInput(CLOCK)
        with fake_job_context():
            call, handle = await start_live(engine, hotel, tmp_path, inp, padded=True)
            inp.push(loud(30.0))  # the caller keeps talking over the whole turn
            ids = turn(engine, " The pool is open from seven in the morning until")
            handle.force_text(ids)
            await await_until(
                lambda: call.duplex.stats["turns"] == 1 and not call.duplex.speaking, "the cut turn"
            )
            await await_until(
                lambda: call.output.queued_s == 0 and call.output.stats["segments"] == 1, "playout"
            )
            await ticks_pass(engine)  # what the cut turn still had on its way has arrived (and been dropped)
            result = len(ids), dict(call.duplex.stats), dict(call.output.stats)
            await call.aclose()
            return result

    k, stats, out = asyncio.run(main())
    print(stats, out)
    assert stats["barge_ins"] == 1 and out["cuts"] == 1
    # what was queued or still on its way when the turn ended is dropped, never played: at least
    # the last frame
    played = out["model_s"] + out["flushed_s"] + out["dropped_s"] + out["trimmed_s"]
    assert played == pytest.approx(k * FRAME_S, abs=2e-3)
    assert out["flushed_s"] + out["dropped_s"] >= FRAME_S - 1e-3


class FrameInput(io.AudioInput):
    """Caller frames of a given shape, in real time, for `seconds` from `go`."""

    def __init__(self, rate: int, channels: int, ms: int, seconds: float, empty: bool = False) -> None:
        super().__init__(label="frames")
        self.rate, self.channels, self.ms, self.empty = rate, channels, ms, empty
        self.left = int(seconds * 1000 / ms)
        self.go = asyncio.Event()
        self._t0: float | None = None
        self._n = 0

    async def __anext__(self) -> rtc.AudioFrame:
        await self.go.wait()
        loop = asyncio.get_running_loop()
        self._t0 = self._t0 if self._t0 is not None else loop.time()
        if self._n >= self.left:
            await asyncio.Event().wait()  # a caller who stays silent
        await asyncio.sleep(max(0.0, self._t0 + self._n * self.ms / 1000 - loop.time()))
        self._n += 1
        if self.empty:
            return rtc.AudioFrame(b"", self.rate, self.channels, 0)
        n = self.rate * self.ms // 1000
        return rtc.AudioFrame(
            np.full(n * self.channels, 800, np.int16).tobytes(), self.rate, self.channels, n
        )


def test_bad_input_48k_stereo_8k_mono_and_empty_frames(engine, hotel, tmp_path):
    shapes = {
        "48k_stereo": (48_000, 2, 10, False),
        "8k_mono": (8_000, 1, 20, False),
        "empty": (48_000, 1, 10, True),
    }

    async def main():
        calls = {}
        with fake_job_context():
            for name, (rate, ch, ms, empty) in shapes.items():
                calls[name] = await start_call(
                    engine,
                    HotelAgent(hotel),
                    sink=WavSink(tmp_path / f"{name}.wav", OUT_RATE),
                    audio_input=FrameInput(rate, ch, ms, 2.0, empty),
                    acks=False,
                )
            for c in calls.values():
                await c.wait_open()
            await await_until(lambda: all(c.duplex.live for c in calls.values()), "the sessions to go live")
            base = {n: c.duplex.stats["frames_out"] for n, c in calls.items()}
            for c in calls.values():
                c.session.input.audio.go.set()
            await await_until(
                lambda: all(c.duplex.stats["frames_out"] - base[n] >= 30 for n, c in calls.items()), "2.4 s"
            )
            by_id = {s.id: s for s in engine.snapshot().sessions}
            got = {n: (by_id[c.handle.id].frames_in, by_id[c.handle.id].phase) for n, c in calls.items()}
            for c in calls.values():
                await c.aclose()
            return got

    got = asyncio.run(main())
    print(got)
    frames = 2000 // CLOCK.frame_ms  # the caller's 2 s in engine frames, less what the resampler holds back
    assert frames - 3 <= got["48k_stereo"][0] <= frames
    assert frames - 3 <= got["8k_mono"][0] <= frames
    assert got["empty"][0] == 0
    assert all(phase == "live" for _, phase in got.values())


class SlowHotel:
    """The hotel, but every tool call blocks until released (a slow database)."""

    def __init__(self, hotel) -> None:
        self._hotel = hotel
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name):
        return getattr(self._hotel, name)

    def call(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(TIMEOUT_S)
        try:
            return self._hotel.call(*args, **kwargs)
        finally:
            self.finished.set()


def test_caller_leaves_during_a_tool_call(engine, hotel, tmp_path):
    """The caller hangs up while a tool runs: the slot is freed at once, the late result goes nowhere, nothing
    is left behind (occupancy back to where it was), and the freed slot serves a fresh call."""
    slow = SlowHotel(hotel)

    async def main():
        await await_until(lambda: engine.occupancy == 0, "the earlier tests' slots to be freed")
        inp = PcmInput(CLOCK)
        with fake_job_context():
            call = await start_call(
                engine, HotelAgent(slow), sink=WavSink(tmp_path / "out.wav", OUT_RATE), audio_input=inp
            )
            handle = await call.wait_open()
            handle.pad_between(True)  # no turn or call of the dummy weights' own
            await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
            args = {"check_in": TODAY.isoformat(), "nights": 2, "guests": 2}
            handle.force_function(engine.tokens.call_ids([{"name": "check_availability", "arguments": args}]))
            await await_until(slow.entered.is_set, "the tool to start")
            inp.end()
            closing = asyncio.create_task(call.aclose())  # what the worker does when the caller leaves
            await await_until(lambda: engine.occupancy == 0, "the slot to be freed")
            assert not slow.finished.is_set()  # freed while the tool still runs
            slow.release.set()
            await await_until(slow.finished.is_set, "the late tool to finish")
            await closing
            await ticks_pass(engine)  # the closed slot's tick has come and gone
            handle.submit_tool_result("late", "{}")  # a late answer to a closed session is ignored
            leftover = [s.id for s in engine.snapshot().sessions if s.id == handle.id]
            # the slot serves a new caller from a fresh state
            again = await start_call(
                engine, HotelAgent(hotel), sink=WavSink(tmp_path / "again.wav", OUT_RATE)
            )
            await again.wait_open()
            await await_until(lambda: again.duplex.stats["frames_out"] >= 3, "the next call to go live")
            stats = dict(call.duplex.stats)
            await again.aclose()
            return leftover, stats

    leftover, stats = asyncio.run(main())
    print(stats)
    assert leftover == []
    assert stats["function_calls"] == 1 and stats["tool_results"] == 0 and stats["resumes"] == 0
    assert [r for r in hotel.reservations()] == []
    asyncio.run(await_until(lambda: engine.occupancy == 0, "the last slot to be freed"))


def test_caller_audio_before_the_slot_opens_reaches_the_engine(engine):
    """The framework forwards the caller's track from the moment it is up, which can be before the engine slot
    is open (the session is configured later): those frames are held and handed over first, in order, so
    every frame pushed reaches the engine."""

    async def main():
        model = ChorusModel(engine)
        session = model.session()
        chunk = loud(FRAME_S)
        for _ in range(10):  # no slot yet: the session is not configured
            session.push_audio(rtc.AudioFrame(chunk.tobytes(), IN_RATE, 1, chunk.size))
        held = (session.handle, session.stats["frames_held"])
        await session._update_session(instructions="You are the concierge.", tools=[])
        await await_until(session.opened.is_set, "the slot to open")
        for _ in range(5):
            session.push_audio(rtc.AudioFrame(chunk.tobytes(), IN_RATE, 1, chunk.size))
        stats, frames_in = dict(session.stats), session.handle.frames_in
        await model.aclose()
        return held, stats, frames_in

    held, stats, frames_in = asyncio.run(main())
    print(stats, "frames in", frames_in)
    assert held == (None, 10)
    assert stats["frames_pushed"] == 15 and frames_in == 15 and stats["held_dropped"] == 0


def test_a_forwarding_failure_is_counted_and_the_call_keeps_its_audio(engine, monkeypatch):
    """A fault inside push_audio (here the input converter raising once: an injected fault, since nothing in
    the path fails on valid frames) must not escape into the framework's forwarding task, which would end
    the call's audio: it is counted, and the frames after it still arrive."""

    async def main():
        model = ChorusModel(engine)
        session = model.session()
        await session._update_session(instructions="You are the concierge.", tools=[])
        await await_until(session.opened.is_set, "the slot to open")
        chunk = loud(FRAME_S)
        real = InputConverter.push
        calls = {"n": 0}

        def flaky(converter, frame):  # only this session pushes audio here
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("resampler fault")
            return real(converter, frame)

        monkeypatch.setattr(InputConverter, "push", flaky)
        for _ in range(6):
            session.push_audio(rtc.AudioFrame(chunk.tobytes(), IN_RATE, 1, chunk.size))  # must not raise
        stats, frames_in = dict(session.stats), session.handle.frames_in
        await model.aclose()
        return stats, frames_in

    stats, frames_in = asyncio.run(main())
    assert stats["input_errors"] == 1
    assert stats["frames_pushed"] == frames_in == 5  # the five good frames, the one after the fault too


def test_a_long_call_keeps_a_bounded_history_and_its_tools_still_answer_once(
    engine, hotel, tmp_path, monkeypatch, caplog
):
    """The framework's per-call history and event record are trimmed as the call goes on (here to 4 items and
    8 events, so a short call shows it). Calls made after a trim still run their tool once, hand the result
    to the engine once, and the adapter never sees an item removed from under it."""
    import agent.history

    monkeypatch.setattr(agent.history, "HISTORY_ITEMS", 4)
    monkeypatch.setattr(agent.history, "EVENTS_KEPT", 8)
    tok = engine.tokens

    async def main():
        with fake_job_context():
            call = await start_call(engine, HotelAgent(hotel), sink=WavSink(tmp_path / "out.wav", OUT_RATE))
            handle = await call.wait_open()
            handle.pad_between(True)  # no turn or call of the dummy weights' own
            await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
            sizes = []
            guests = [("Ada Lovelace", "2030-03-12"), ("Grace Hopper", "2030-04-12")]
            for n in range(1, 13):
                handle.force_text(turn(engine, f" Reply {n}."))
                await await_until(
                    lambda n=n: call.duplex.stats["turns"] == n and not call.duplex.speaking, "a turn"
                )
                if n in (6, 12):  # a call after the history was trimmed (and a second one)
                    calls = call.duplex.stats["resumes"] + 1
                    guest, check_in = guests.pop(0)
                    args = booking(guest_name=guest, check_in=check_in, nights=2)
                    handle.force_function(tok.call_ids([{"name": "book_room", "arguments": args}]))
                    await await_until(
                        lambda c=calls: call.duplex.stats["resumes"] == c, "the result to be consumed"
                    )
                report = get_job_context().make_session_report(call.session)  # what the job would report
                sizes.append((len(call.session.history.items), len(report.events)))
            stats = dict(call.duplex.stats)
            await call.aclose()
            return sizes, stats

    with caplog.at_level("WARNING"):
        sizes, stats = asyncio.run(main())
    print(sizes, stats)
    assert max(h for h, _ in sizes) < 2 * 4 + 2  # trimmed back to 4 whenever it reached 8 (+ instructions)
    assert max(e for _, e in sizes) < 2 * 8
    assert stats["function_calls"] == 2 and stats["tool_results"] == 2 and stats["resumes"] == 2
    assert sorted(r.guest_name for r in hotel.reservations()) == ["Ada Lovelace", "Grace Hopper"]
    assert not [r for r in caplog.records if "append-only" in r.getMessage()]


@pytest.mark.parametrize("rate", [OUT_RATE, ROOM_RATE])
def test_a_call_ended_on_the_agents_side_plays_its_last_words(engine, hotel, tmp_path, rate):
    """The call ends right as the model's last turn ends: everything it said still plays, all of it (the
    playout buffer and, at a room track's 48 kHz, the resampler's tail), and the WAV holds it."""

    async def main():
        with fake_job_context():
            sink = WavSink(tmp_path / "out.wav", rate)
            call = await start_call(engine, HotelAgent(hotel), sink=sink)
            handle = await call.wait_open()
            handle.pad_between(True)  # no turn or call of the dummy weights' own
            await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
            handle.force_text(turn(engine, " Thank you for calling, goodbye now."))
            await await_until(
                lambda: call.duplex.stats["turns"] == 1 and not call.duplex.speaking, "the last turn"
            )
            await call.aclose(play_out=True)
            return dict(call.duplex.stats), dict(call.output.stats)

    stats, out = asyncio.run(main())
    print(stats, out)
    said = stats["speech_frames"] * FRAME_S
    # (less the quiet stretches the playout cut once the turn had waited longer than the jitter needs)
    assert said > 0.5 and abs(out["model_s"] + out["trimmed_s"] - said) < 2e-3, (said, out)
    assert out["trimmed_s"] <= 0.1
    # nothing it said was cut: the wind-down waited for the last chunk to end (under a millisecond is a
    # rounding of the play clock, not a sound)
    assert out["flushed_s"] + out["dropped_s"] < 1e-3, out
    with wave.open(str(tmp_path / "out.wav"), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    assert np.count_nonzero(pcm) >= int(0.9 * said * rate)  # the speech is in the file, not cut at its end
