"""The native caller audio (agent/audio_in/native/audio_pump.c through agent/audio_in/audio_pump.py): the rtc
runtime's events as its native library delivers them (protobuf bytes, built here with the SDK's own message
classes), a session's real shared memory (engine/transport/link.py) as the ring, and stand-ins for the SDK's
Python callback and the native library's handle drop that record what reached them.

Each test loads its own copy of the library (built into the test's directory), so the process-wide state of
the one a worker installs is never touched."""

from __future__ import annotations

import ctypes
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from livekit.rtc._proto import ffi_pb2

from agent.audio_in import audio_pump
from engine.transport.link import IN_R, IN_W, Layout, SessionLink

pytestmark = [  # frames timed against the tick on the wall clock (serial: tests/conftest.py)
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
    pytest.mark.serial,
]

RATE, FRAME = 16_000, 1280
LOUD = (0.02 * 32768.0) ** 2  # agent/duplex.py VOICED_ENERGY
EVENT = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t)
DROP = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_uint64)
REQUEST = ctypes.CFUNCTYPE(
    ctypes.c_uint64,
    ctypes.POINTER(ctypes.c_uint8),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)),
    ctypes.POINTER(ctypes.c_size_t),
)


class Pump:
    """A private copy of the library `built` (its own file in `directory`, so its own state once loaded), its
    forwarded events and dropped handles recorded."""

    def __init__(self, built: Path, directory: Path) -> None:
        own = directory / built.name
        shutil.copyfile(built, own)
        self.lib = audio_pump.load(own)
        self.forwarded: list[bytes] = []
        self.dropped: list[int] = []
        self._fwd = EVENT(lambda p, n: self.forwarded.append(ctypes.string_at(p, n)))
        self._drop = DROP(lambda h: self.dropped.append(int(h)) or True)
        # the native library's requests: each one's bytes and the samples its buffer pointed at when made,
        # answered with the async id asked for (or `answer_id`, as a runtime that ignores it would)
        self.requests: list[tuple[ffi_pb2.FfiRequest, np.ndarray]] = []
        self.answer_id: int | None = None
        self._answers: list[object] = []
        self._request = REQUEST(self._on_request)
        audio_pump.init(
            self.lib,
            audio_pump._address(self._fwd),
            audio_pump._address(self._drop),
            audio_pump._address(self._request),
        )
        self._keep: list[object] = []  # the sample buffers the events point at, alive until sent
        self._next_buffer = 1000

    def _on_request(self, data, n, res, res_n) -> int:
        req = ffi_pb2.FfiRequest()
        req.ParseFromString(ctypes.string_at(data, n))
        info = req.capture_audio_frame.buffer
        seen = np.ctypeslib.as_array(
            ctypes.cast(info.data_ptr, ctypes.POINTER(ctypes.c_int16)), (info.samples_per_channel,)
        ).copy()
        self.requests.append((req, seen))
        resp = ffi_pb2.FfiResponse()
        resp.capture_audio_frame.async_id = (
            req.capture_audio_frame.request_async_id if self.answer_id is None else self.answer_id
        )
        body = resp.SerializeToString()
        buf = (ctypes.c_uint8 * len(body)).from_buffer_copy(body)
        self._answers.append(buf)
        res[0] = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
        res_n[0] = len(body)
        return 77  # the answer's handle, dropped by the caller

    def capture_done(self, async_id: int, error: str = "") -> bytes:
        ev = ffi_pb2.FfiEvent()
        ev.capture_audio_frame.async_id = async_id
        if error:
            ev.capture_audio_frame.error = error
        return ev.SerializePartialToString()

    def frame_event(self, stream: int, samples: np.ndarray, *, rate: int = RATE, channels: int = 1) -> bytes:
        buf = np.ascontiguousarray(samples, dtype=np.int16)
        self._keep.append(buf)
        self._next_buffer += 1
        ev = ffi_pb2.FfiEvent()
        ase = ev.audio_stream_event
        ase.stream_handle = stream
        fr = ase.frame_received.frame
        fr.handle.id = self._next_buffer
        fr.info.data_ptr = buf.ctypes.data
        fr.info.num_channels, fr.info.sample_rate = channels, rate
        fr.info.samples_per_channel = buf.size // channels
        return ev.SerializeToString()

    def send(self, data: bytes) -> None:
        arr = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        self.lib.pump_event(arr, len(data))

    def register(self, stream: int, hold: int = 4) -> audio_pump.NativeStream:
        return audio_pump.NativeStream(self.lib, stream, RATE, FRAME, LOUD, hold)

    def totals(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(audio_pump.TOTALS))()
        self.lib.pump_totals(out)
        return dict(zip(audio_pump.TOTALS, map(int, out), strict=True))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The library compiled once for the module, in a folder of its own; each test loads a copy (`Pump`)."""
    return audio_pump.build(directory=tmp_path_factory.mktemp("audio_pump"))


@pytest.fixture
def pump(built, tmp_path):
    return Pump(built, tmp_path)


@pytest.fixture
def link():
    link = SessionLink.create(Layout(in_samples=FRAME, out_samples=1764))
    yield link
    link.close()


def tone(n: int, start: int = 0, amp: int = 3000) -> np.ndarray:
    return (amp * np.sin(np.arange(start, start + n) * 0.05)).astype(np.int16)


def test_a_registered_streams_frames_land_in_the_ring_and_their_buffers_are_dropped(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    a, b = tone(FRAME), tone(FRAME, FRAME)
    before = time.monotonic()
    pump.send(pump.frame_event(7, a))
    pump.send(pump.frame_event(7, b))
    taken, stamps, r, lost = link.take_caller(0, time.monotonic())
    assert (r, lost) == (2, 0) and link.get(IN_W) == 2
    assert np.array_equal(taken[0], a) and np.array_equal(taken[1], b)
    assert (
        before <= stamps[0] <= stamps[1] <= time.monotonic()
    )  # written at arrival, on time.monotonic's clock
    assert pump.dropped == [1001, 1002]  # each frame's native buffer, once
    assert pump.forwarded == []  # nothing of them reached Python
    s = stream.stats()
    assert (s["frames"], s["written"], s["ring_full"], s["bad"]) == (2, 2, 0, 0)
    assert pump.totals()["consumed"] == 2


def test_pieces_of_any_length_are_cut_into_whole_engine_frames(pump, link):
    stream = pump.register(7)  # (a stream dropped without being closed unregisters itself)
    stream.attach(link.caller_ring())
    audio = tone(3 * FRAME + 100)
    for piece in np.split(audio, [480, 1900, 2000, 3700]):  # 30 ms, 89 ms, 6 ms, 106 ms, 12 ms
        pump.send(pump.frame_event(7, piece))
    taken, _, r, _ = link.take_caller(0, time.monotonic())
    assert r == 3
    assert np.array_equal(taken.reshape(-1), audio[: 3 * FRAME])  # the last 100 samples wait for more
    pump.send(pump.frame_event(7, tone(FRAME - 100, 3 * FRAME + 100)))
    taken, _, r, _ = link.take_caller(3, time.monotonic())
    assert r == 4 and np.array_equal(taken[0], tone(FRAME, 3 * FRAME))


def test_frames_before_the_slot_opens_are_held_the_oldest_dropped_then_written_in_order(pump, link):
    stream = pump.register(7, hold=4)
    frames = [tone(FRAME, k * FRAME) for k in range(6)]
    for f in frames:
        pump.send(pump.frame_event(7, f))
    assert link.get(IN_W) == 0
    s = stream.stats()
    assert (s["held"], s["held_dropped"], s["written"]) == (6, 2, 0)
    link.set(IN_W, 3)  # what the room wrote itself before handing the ring over
    link.set(IN_R, 3)
    stream.attach(link.caller_ring())
    taken, _, r, _ = link.take_caller(3, time.monotonic())
    assert r == 7 and all(np.array_equal(t, f) for t, f in zip(taken, frames[2:], strict=True))
    pump.send(pump.frame_event(7, tone(FRAME, 99)))
    assert link.take_caller(7, time.monotonic())[2] == 8


def test_a_full_ring_drops_and_counts_the_frame_until_the_engine_takes_what_is_there(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    for k in range(link.layout.in_frames + 3):
        pump.send(pump.frame_event(7, tone(FRAME, k)))
    s = stream.stats()
    assert (s["written"], s["ring_full"]) == (link.layout.in_frames, 3)
    _, _, r, lost = link.take_caller(0, time.monotonic())
    assert (r, lost) == (link.layout.in_frames, 0)
    pump.send(pump.frame_event(7, tone(FRAME)))
    assert stream.stats()["written"] == link.layout.in_frames + 1


def test_a_frame_of_another_rate_or_layout_is_refused_and_counted_never_written(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    pump.send(pump.frame_event(7, tone(FRAME), rate=48_000))
    pump.send(pump.frame_event(7, tone(2 * FRAME), channels=2))
    pump.send(pump.frame_event(7, tone(0)))
    s = stream.stats()
    assert (s["bad"], s["frames"], link.get(IN_W)) == (3, 0, 0)
    assert pump.dropped == [1001, 1002, 1003] and pump.forwarded == []  # refused, and still freed


def test_every_other_event_reaches_the_sdks_callback_unchanged(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    other_stream = pump.frame_event(8, tone(FRAME))  # a stream of the SDK's own (an AudioStream in Python)
    room = ffi_pb2.FfiEvent()
    room.room_event.room_handle = 5
    room.room_event.participant_connected.info.info.identity = "caller"
    logs = ffi_pb2.FfiEvent()
    logs.logs.records.add(message="hello", target="livekit")
    eos = ffi_pb2.FfiEvent()
    eos.audio_stream_event.stream_handle = 7
    eos.audio_stream_event.eos.SetInParent()
    events = [other_stream, *(e.SerializePartialToString() for e in (room, logs, eos))]
    garbage = [b"", b"\xff\xff\xff", pump.frame_event(7, tone(FRAME))[:-5], b"\x22\x05\x08"]
    for e in events + garbage:
        pump.send(e)
    assert (
        pump.forwarded == events + garbage
    )  # in order, byte for byte; malformed bytes are Python's to refuse
    assert link.get(IN_W) == 0 and pump.dropped == []


def test_a_closed_streams_frame_still_in_flight_is_dropped_not_forwarded(pump, link):
    import asyncio

    stream = pump.register(7)
    stream.attach(link.caller_ring())
    pump.send(pump.frame_event(7, tone(FRAME)))
    asyncio.run(stream.aclose())
    assert stream.stats()["written"] == 1  # its counters outlive it
    pump.send(pump.frame_event(7, tone(FRAME)))
    assert link.get(IN_W) == 1 and pump.forwarded == [] and pump.dropped == [1001, 1002]
    assert pump.totals()["late"] == 1


def test_detached_frames_are_held_not_written_into_a_session_that_is_closing(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    pump.send(pump.frame_event(7, tone(FRAME)))
    stream.detach()
    pump.send(pump.frame_event(7, tone(FRAME)))
    assert link.get(IN_W) == 1 and stream.stats()["held"] == 1


def test_only_a_loud_frame_marks_when_the_caller_last_spoke(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    pump.send(pump.frame_event(7, tone(FRAME, amp=200)))  # about -44 dBFS: below the speech threshold
    assert stream.stats()["voiced_at"] == 0.0
    t0 = time.monotonic()
    pump.send(pump.frame_event(7, tone(FRAME, amp=3000)))
    assert t0 <= stream.stats()["voiced_at"] <= time.monotonic()


PIECE = RATE // 100  # the runtime's 10 ms pieces (audio_pump.PIECE_MS)
LEAD = 0.008  # the lead asked for (the tick's least margin, engine/tick/phase.py)


def quiet(k: int) -> np.ndarray:
    """A piece far below the speech threshold, told apart from the others by its value."""
    return np.full(PIECE, k % 60 + 1, np.int16)


def feed(pump, link, pieces, since: float | list[float]) -> None:
    """Stream 7's pieces, each sent as though the engine took its frames `since` seconds before it (per frame
    when a list: the frame the piece is in)."""
    for i, piece in enumerate(pieces):
        ago = since if isinstance(since, float) else since[i * PIECE // FRAME]
        link.taken_at[0] = time.monotonic() - ago
        pump.send(pump.frame_event(7, piece))


def test_frames_that_wait_for_their_tick_are_cut_later_by_leaving_out_quiet_pieces(pump, link):
    """Frames that end 50 ms before the next tick (the engine took the last ones 30 ms before): after six of
    them, the four quiet pieces that come next are left out, so the frames after end 10 ms ahead of the tick,
    by the 8 ms lead asked for and within a piece; nothing else of the audio is lost or reordered."""
    stream = pump.register(7)
    stream.attach(link.caller_ring(), LEAD)
    pieces = [quiet(k) for k in range(48 + 4 + 16)]
    feed(pump, link, pieces, 0.030)
    taken, _, r, _ = link.take_caller(0, time.monotonic())
    assert r == 8
    assert np.array_equal(taken.reshape(-1), np.concatenate(pieces[:48] + pieces[52:]))
    assert stream.stats()["aligned"] == 4 * PIECE


def test_a_loud_piece_is_never_left_out(pump, link):
    """The caller speaks when the frames' cut would move: the loud pieces go in whole, and the quiet ones
    after them are left out instead."""
    stream = pump.register(7)
    stream.attach(link.caller_ring(), LEAD)
    loud = [tone(PIECE, k * PIECE) for k in range(3)]
    pieces = [quiet(k) for k in range(48)] + loud + [quiet(k) for k in range(100, 100 + 4 + 13)]
    feed(pump, link, pieces, 0.030)
    taken, _, r, _ = link.take_caller(0, time.monotonic())
    assert r == 8
    assert np.array_equal(taken.reshape(-1), np.concatenate(pieces[:51] + pieces[55:]))
    assert stream.stats()["aligned"] == 4 * PIECE


@pytest.mark.parametrize(
    "case, lead_s, since",
    [
        ("already within a piece of the lead", LEAD, 0.065),  # leads of 15 ms
        ("leads that are not steady", LEAD, [0.030, 0.040] * 3 + [0.030] * 3),
        ("an engine that has stopped taking", LEAD, 1.0),
        ("no lead asked for", 0.0, 0.030),
    ],
)
def test_the_frames_cut_stays_where_it_is(pump, link, case, lead_s, since):
    stream = pump.register(7)
    stream.attach(link.caller_ring(), lead_s)
    pieces = [quiet(k) for k in range(72)]
    feed(pump, link, pieces, since)
    taken, _, r, _ = link.take_caller(0, time.monotonic())
    assert r == 9 and np.array_equal(taken.reshape(-1), np.concatenate(pieces)), case
    assert stream.stats()["aligned"] == 0


def test_the_first_piece_of_a_stream_being_opened_is_dropped_not_handed_to_python(pump, link):
    """Pieces come every 10 ms from the moment the runtime makes a stream, so the first may come before its
    handle is registered: while a stream is being opened, a piece of a stream newer than every registered
    one is dropped (its buffer too) and counted; an older unknown stream's still reaches Python."""
    pump.register(5)
    pump.lib.pump_opening(1)
    early = pump.frame_event(9, quiet(1))
    pump.send(early)
    other = pump.frame_event(4, quiet(2))  # a stream made before, read by the SDK's Python (not registered)
    pump.send(other)
    stream = pump.register(9)
    pump.lib.pump_opening(-1)
    newer = pump.frame_event(11, quiet(3))
    pump.send(newer)  # none being opened: an unknown stream's goes to Python
    assert pump.totals()["early"] == 1
    assert pump.forwarded == [other, newer]
    assert pump.dropped == [1001]  # the early piece's buffer, and no other
    assert stream.stats()["frames"] == 0


def test_a_stream_cannot_be_registered_twice_nor_attached_to_a_ring_of_another_frame(pump, link):
    first = pump.register(7)
    with pytest.raises(audio_pump.PumpUnavailable):
        pump.register(7)
    assert first.stats()["frames"] == 0  # the refused second one took nothing of the first
    other = SessionLink.create(Layout(in_samples=640, out_samples=1764))
    try:
        with pytest.raises(audio_pump.PumpUnavailable):
            audio_pump.NativeStream(pump.lib, 9, RATE, FRAME, LOUD, 4).attach(other.caller_ring())
    finally:
        other.close()


def test_a_stream_dropped_without_being_closed_frees_its_entry(pump, link):
    stream = pump.register(7)
    stream.attach(link.caller_ring())
    del stream
    pump.send(pump.frame_event(7, tone(FRAME)))
    assert link.get(IN_W) == 0 and pump.totals()["late"] == 1 and pump.forwarded == []
    again = pump.register(7)  # the handle may be used again
    again.attach(link.caller_ring())
    pump.send(pump.frame_event(7, tone(FRAME)))
    assert link.get(IN_W) == 1


def logs_event(*records: tuple[int, str]) -> bytes:
    ev = ffi_pb2.FfiEvent()
    for level, target in records:
        ev.logs.records.add(level=level, target=target, message="m", module_path="x", line=1)
    return ev.SerializePartialToString()


LEVELS = ("LOG_TRACE", "LOG_DEBUG", "LOG_INFO", "LOG_WARN")
TRACE, DEBUG, INFO, WARN = (ffi_pb2.LogLevel.Value(n) for n in LEVELS)


def test_the_runtimes_log_records_that_python_would_throw_away_never_cross_into_it(pump):
    thrown = [
        logs_event((TRACE, "libwebrtc"), (TRACE, "my_app")),  # traces: the SDK never logs them
        logs_event((DEBUG, "libwebrtc"), (DEBUG, "livekit_ffi::server"), (TRACE, "livekit")),
    ]
    kept = [
        logs_event((DEBUG, "libwebrtc"), (INFO, "livekit")),  # one record worth logging: the batch goes whole
        logs_event((WARN, "libwebrtc")),
        logs_event((DEBUG, "my_app")),  # a debug record not of the runtime's: the SDK logs it at DEBUG
    ]
    for e in thrown + kept:
        pump.send(e)
    assert pump.forwarded == kept
    assert pump.totals()["quiet_logs"] == 2


def test_with_the_sdks_rtc_debug_on_the_runtimes_debug_records_reach_python(built, tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEKIT_RTC_DEBUG", "true")
    pump = Pump(built, tmp_path)
    debug, trace = logs_event((DEBUG, "libwebrtc")), logs_event((TRACE, "libwebrtc"))
    pump.send(debug)
    pump.send(trace)
    assert pump.forwarded == [debug]


class FakeSource:
    """What `TrackCapture` reads of an `rtc.AudioSource`: its FFI handle and rate."""

    def __init__(self, handle: int, rate: int = 48_000) -> None:
        self._ffi_handle = type("H", (), {"handle": handle})()
        self.sample_rate = rate


def test_the_agents_frames_are_captured_by_a_request_made_natively_and_its_answer_taken_there(pump):
    track = audio_pump.TrackCapture(pump.lib, FakeSource(41), slow_s=2.0)
    frame = tone(3840)
    assert track.capture(frame)
    frame[:] = 0  # the request carries a copy: the caller's array is free at once
    [(req, seen)] = pump.requests
    cap = req.capture_audio_frame
    assert (cap.source_handle, cap.buffer.num_channels, cap.buffer.sample_rate) == (41, 1, 48_000)
    assert cap.buffer.samples_per_channel == 3840 and np.array_equal(seen, tone(3840))
    assert pump.dropped == [77]  # the answer's buffer
    assert track.stats()["sent"] == 1 and track.stats()["done"] == 0
    pump.send(pump.capture_done(cap.request_async_id))
    assert pump.forwarded == []  # the answer never reached Python
    assert (track.stats()["done"], track.stats()["errors"], track.stats()["slow"]) == (1, 0, 0)
    other = pump.capture_done(5)  # a capture of the SDK's own AudioSource: Python's to take
    pump.send(other)
    assert pump.forwarded == [other]


def test_a_refused_or_slow_capture_is_counted(pump):
    track = audio_pump.TrackCapture(pump.lib, FakeSource(41), slow_s=0.0)
    track.capture(tone(480))
    pump.send(
        pump.capture_done(pump.requests[-1][0].capture_audio_frame.request_async_id, error="queue closed")
    )
    s = track.stats()
    assert (s["done"], s["errors"], s["slow"]) == (1, 1, 1)
    unknown = audio_pump.TrackCapture(pump.lib, FakeSource(42), slow_s=1.0)
    unknown.close()
    assert not unknown.capture(tone(480))  # a closed track takes nothing
    assert len(pump.requests) == 1


def test_a_runtime_that_answers_with_its_own_id_still_has_its_answer_taken(pump):
    track = audio_pump.TrackCapture(pump.lib, FakeSource(41), slow_s=2.0)
    pump.answer_id = 9_000
    track.capture(tone(480))
    pump.send(pump.capture_done(9_000))
    assert pump.forwarded == [] and track.stats()["done"] == 1


def test_captures_never_answered_give_their_entries_up_once_every_entry_is_taken(pump):
    """A capture the runtime never answers (its source closed under it) must not hold its entry forever: once
    every entry is taken, the oldest unanswered past the reclaim age makes room, counted as an error."""
    track = audio_pump.TrackCapture(pump.lib, FakeSource(41), slow_s=2.0)
    n = pump.lib.pump_max_captures()
    assert all(track.capture(tone(48)) for _ in range(n))
    assert not track.capture(tone(48))  # every entry taken, none old enough: refused and counted
    assert track.stats()["refused"] == 1
    pump.lib.pump_set_reclaim(0.0)
    assert track.capture(tone(48))  # the oldest gave its entry up
    assert track.stats()["errors"] == 1


def test_frames_at_the_engines_rate_are_resampled_to_the_tracks_before_their_capture(pump):
    """A track opened to take 22,050 Hz frames: each 80 ms frame goes out as one 80 ms capture at the source's
    48 kHz, the samples being the native resampler's (tests/test_resample.py), continuous across captures."""
    track = audio_pump.TrackCapture(pump.lib, FakeSource(41), slow_s=2.0, rate=22_050)
    assert track.rate == 22_050
    x = tone(1764 * 3, amp=9000)
    for i in range(3):
        assert track.capture(x[i * 1764 : (i + 1) * 1764])
    caps = [req.capture_audio_frame for req, _ in pump.requests]
    assert [(c.buffer.sample_rate, c.buffer.samples_per_channel) for c in caps] == [(48_000, 3840)] * 3
    out = np.concatenate([seen for _, seen in pump.requests]).astype(float)
    # the same tone at 48 kHz, 0.73 ms later (the filter's delay), to within int16 rounding
    t = np.arange(out.size) * 22_050 / 48_000 - (320 * 32 - 1) / 2 / 320
    ref = 9000 * np.sin(t * 0.05)
    assert np.abs(out[200:] - ref[200:]).max() < 2.0
    native_rate = audio_pump.TrackCapture(pump.lib, FakeSource(43), slow_s=2.0)
    assert native_rate.rate == 48_000 and native_rate.capture(tone(480))
    assert pump.requests[-1][0].capture_audio_frame.buffer.samples_per_channel == 480  # no resampling
