"""The call's audio and the rtc runtime without Python in between: the caller's frames from the runtime
straight into the engine's caller ring, and the agent's captures into its track made and answered natively.

A room's caller track reaches the engine through `agent/audio_in/native/audio_pump.c`, the callback the rtc
SDK's native library calls with every event. A caller track's stream (16 kHz mono, in 10 ms pieces) is
registered there; its pieces are cut into the engine's frames, where the frames' ends fall just ahead of the
engine's ticks, and written into the session's shared memory (engine/transport/link.py) by the callback's own
thread, and their native buffers dropped. No event of theirs crosses into Python, and no Python runs for them:
the room's loop and the interpreter see none of the hundred pieces a second a caller sends. Every other event
reaches the SDK's Python callback as before, but for the runtime's batches of debug and trace log records,
which that callback would parse only to throw away.

- `install()` (agent/audio_in/rtc_ffi.py, before the process's FFI client exists) builds the callback once
  (`cc`, cached by the source's hash under CHORUS_NATIVE_CACHE, default ~/.cache/chorus/native) and hands it
  to the native library in place of the SDK's; without a C compiler, or with CHORUS_NATIVE_AUDIO=false, the
  caller's audio takes the framework's path (livekit-agents' room input and `ChorusSession.push_audio`).
- `TrackCapture` is the agent's track (agent/audio_out/sinks.py `RoomSink`): each frame the playout hands it
  is copied and captured into the track's audio source by a request the library makes, and the runtime's
  answer is taken there too, where the SDK's `capture_frame` subscribes a queue to the FFI client per capture
  and waits on the room's loop for the answer.
- `NativeStream` is one caller track's stream, registered with the callback (a call's streams are
  agent/audio_in/caller_input.py's).
Knows the rtc SDK's FFI (the version agent/audio_in names); nothing of sessions, the framework or tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("chorus.agent.audio_pump")

NATIVE = Path(__file__).with_name("native")
SOURCE = NATIVE / "audio_pump.c"
# compiled with it into one library, and part of its build's hash (with the headers they share)
WITH = (NATIVE / "capture.c", NATIVE / "resample.c", NATIVE / "pump.h", NATIVE / "resample.h")
CFLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-pthread")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 60.0
PIECE_MS = 10  # the caller's audio from the runtime in pieces this long: the frames' cut, chosen to this
STATS = ("frames", "written", "ring_full", "held", "held_dropped", "bad", "voiced_at", "aligned")
TOTALS = ("consumed", "forwarded", "late", "streams", "quiet_logs", "early")

_lock = threading.Lock()
_state: dict[str, Any] = {}


class PumpUnavailable(RuntimeError):
    """The native caller audio cannot run here (no compiler, a failed build, an SDK not the one expected)."""


def cache_dir() -> Path:
    return Path(os.environ.get("CHORUS_NATIVE_CACHE") or Path.home() / ".cache" / "chorus" / "native")


def build(source: Path = SOURCE, directory: Path | None = None, with_: tuple[Path, ...] = WITH) -> Path:
    """The compiled library for `source` and `with_` (its other C files and headers), built once per their
    texts (several processes building at once each finish and the last rename wins, all with the same
    bytes)."""
    directory = cache_dir() if directory is None else directory
    text = b"".join(p.read_bytes() for p in (source, *with_))
    digest = hashlib.sha256(text + " ".join(CFLAGS + LIBS).encode()).hexdigest()[:16]
    lib = directory / f"{source.stem}-{digest}.so"
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PumpUnavailable("no C compiler (cc) to build the native caller audio")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, str(source), *(str(p) for p in with_ if p.suffix == ".c"), *LIBS],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise PumpUnavailable(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return lib


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    u64, i32, f64 = ctypes.c_uint64, ctypes.c_int, ctypes.c_double
    lib.pump_init.argtypes = [*(ctypes.c_void_p,) * 3, ctypes.POINTER(ctypes.c_int32), i32]
    lib.pump_source_open.argtypes = [u64, f64, i32, i32]
    lib.pump_source_close.argtypes = [u64]
    lib.pump_capture.argtypes = [u64, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
    lib.pump_capture_stats.argtypes = [u64, ctypes.POINTER(f64), i32]
    lib.pump_set_reclaim.argtypes = [f64]
    lib.pump_set_reclaim.restype = None
    lib.pump_register.argtypes = [u64, i32, i32, f64, i32]
    lib.pump_attach.argtypes = [u64, ctypes.c_void_p, *(ctypes.c_int64,) * 5, i32, ctypes.c_int64, f64]
    lib.pump_detach.argtypes = lib.pump_unregister.argtypes = [u64]
    lib.pump_opening.argtypes = [i32]
    lib.pump_opening.restype = None
    lib.pump_stats.argtypes = [u64, ctypes.POINTER(f64), i32]
    lib.pump_totals.argtypes = [ctypes.POINTER(u64)]
    lib.pump_totals.restype = None
    lib.pump_event.argtypes = [ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t]
    lib.pump_event.restype = None
    if lib.pump_n_stats() != len(STATS):  # (the fields' count is pump_init's to check)
        raise PumpUnavailable("the native caller audio's counters are not the ones expected")
    return lib


def field_numbers() -> list[int]:
    """The protobuf field numbers the callback walks, from the rtc SDK's own descriptors (the order of the C
    file's F_* list)."""
    from livekit.rtc._proto import audio_frame_pb2, ffi_pb2, handle_pb2

    def num(msg: Any, name: str) -> int:
        return msg.DESCRIPTOR.fields_by_name[name].number

    info = audio_frame_pb2.AudioFrameBufferInfo
    # the runtime's debug records are the SDK's to log with this on (as it reads it)
    rtc_debug = os.environ.get("LIVEKIT_RTC_DEBUG", "").strip().lower() in ("true", "1")
    return [
        num(ffi_pb2.FfiEvent, "audio_stream_event"),
        num(audio_frame_pb2.AudioStreamEvent, "stream_handle"),
        num(audio_frame_pb2.AudioStreamEvent, "frame_received"),
        num(audio_frame_pb2.AudioFrameReceived, "frame"),
        num(audio_frame_pb2.OwnedAudioFrameBuffer, "handle"),
        num(audio_frame_pb2.OwnedAudioFrameBuffer, "info"),
        num(handle_pb2.FfiOwnedHandle, "id"),
        num(info, "data_ptr"),
        num(info, "num_channels"),
        num(info, "sample_rate"),
        num(info, "samples_per_channel"),
        num(ffi_pb2.FfiEvent, "logs"),
        num(ffi_pb2.LogBatch, "records"),
        num(ffi_pb2.LogRecord, "level"),
        num(ffi_pb2.LogRecord, "target"),
        ffi_pb2.LogLevel.LOG_DEBUG,
        ffi_pb2.LogLevel.LOG_TRACE,
        int(rtc_debug),
        num(ffi_pb2.FfiRequest, "capture_audio_frame"),
        num(audio_frame_pb2.CaptureAudioFrameRequest, "source_handle"),
        num(audio_frame_pb2.CaptureAudioFrameRequest, "buffer"),
        num(audio_frame_pb2.CaptureAudioFrameRequest, "request_async_id"),
        num(ffi_pb2.FfiResponse, "capture_audio_frame"),
        num(audio_frame_pb2.CaptureAudioFrameResponse, "async_id"),
        num(ffi_pb2.FfiEvent, "capture_audio_frame"),
        num(audio_frame_pb2.CaptureAudioFrameCallback, "async_id"),
        num(audio_frame_pb2.CaptureAudioFrameCallback, "error"),
    ]


def init(lib: ctypes.CDLL, forward: int | None, drop: int | None, request: int | None) -> None:
    """Point the callback at `forward` (the address of a function taking an event's bytes), `drop` (of one
    dropping a native handle) and `request` (the native library's `livekit_ffi_request`)."""
    numbers = field_numbers()
    arr = (ctypes.c_int32 * len(numbers))(*numbers)
    if lib.pump_init(forward, drop, request, arr, len(numbers)) != 0:
        raise PumpUnavailable("the native caller audio does not walk these events")


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def install() -> bool:
    """Put the native callback in front of the SDK's (once per process, before its FFI client is made).
    False, and said once in the log, when it cannot be: the caller's audio then takes the framework's path."""
    with _lock:
        if "lib" in _state or "error" in _state:
            return "lib" in _state
        try:
            from livekit.rtc import _ffi_client

            if _ffi_client.FfiClient._instance is not None:
                raise PumpUnavailable(
                    "the rtc SDK's FFI client was made before the native callback could go in"
                )
            if not isinstance(getattr(_ffi_client, "ffi_event_callback", None), _ffi_client.ffi_cb_fnc):
                raise PumpUnavailable("the rtc SDK's event callback is not the one expected")
            lib = load(build())
            sdk_callback = _ffi_client.ffi_event_callback
            native = _ffi_client.get_ffi_lib()
            init(
                lib,
                _address(sdk_callback),
                _address(native.livekit_ffi_drop_handle),
                _address(native.livekit_ffi_request),
            )
            _ffi_client.ffi_event_callback = _ffi_client.ffi_cb_fnc(_address(lib.pump_event))
            try:
                _ = _ffi_client.FfiClient.instance  # initialises the native library with the pump's callback
            finally:
                _ffi_client.ffi_event_callback = sdk_callback
        except Exception as e:  # noqa: BLE001 (no compiler, a failed build: the framework's path, said once)
            _state["error"] = str(e)
            log.warning("caller audio goes through Python: %s", e)
            return False
        _state["lib"] = lib
        log.info("caller audio goes from the rtc runtime straight into the engine's ring")
        return True


def installed() -> ctypes.CDLL | None:
    return _state.get("lib")


def totals() -> dict[str, int]:
    lib = installed()
    if lib is None:
        return {}
    out = (ctypes.c_uint64 * len(TOTALS))()
    lib.pump_totals(out)
    return dict(zip(TOTALS, map(int, out), strict=True))


class NativeStream:
    """One caller track's audio stream, its frames the callback's (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL, handle: int, rate: int, frame: int, loud: float, hold: int) -> None:
        self._lib, self.handle = lib, handle
        self.closed = asyncio.Event()
        self._final: dict[str, float] | None = None  # the counters as the stream closed
        if lib.pump_register(handle, rate, frame, loud, hold) != 0:
            self.closed.set()  # nothing of it to unregister
            raise PumpUnavailable(f"the native caller audio could not take stream {handle}")

    @classmethod
    def open(
        cls, lib: ctypes.CDLL, track: Any, rate: int, frame: int, loud: float, hold: int
    ) -> NativeStream:
        """A native audio stream of `track` (16 kHz mono), registered with the callback. The runtime hands its
        audio over in pieces of PIECE_MS (the callback cuts the engine's frames from them, where it chooses:
        aligned with the ticks). A piece that comes before the stream is registered (the first, at most) is
        dropped there and counted (`early`), never handed to Python."""
        from livekit.rtc._ffi_client import FfiClient, FfiHandle
        from livekit.rtc._proto import audio_frame_pb2, ffi_pb2

        req = ffi_pb2.FfiRequest()
        new = req.new_audio_stream
        new.track_handle = track._ffi_handle.handle
        new.sample_rate, new.num_channels, new.queue_size_frames = rate, 1, 0
        new.frame_size_ms = PIECE_MS
        new.type = audio_frame_pb2.AudioStreamType.AUDIO_STREAM_NATIVE
        lib.pump_opening(1)
        try:
            resp = FfiClient.instance.request(req)
            owned = FfiHandle(resp.new_audio_stream.stream.handle.id)
            try:
                stream = cls(lib, owned.handle, rate, frame, loud, hold)
            except BaseException:
                owned.dispose()
                raise
        finally:
            lib.pump_opening(-1)
        stream._owned = owned
        return stream

    def attach(self, ring: Any, lead_s: float = 0.0) -> None:
        """Write into `ring` (engine/transport/link.py `CallerRing`) from now on, after what was held; the
        frames' ends kept `lead_s` ahead of the engine's takes (0: where the stream's start put them)."""
        if (
            self._lib.pump_attach(
                self.handle,
                ring.base,
                ring.in_w,
                ring.in_r,
                ring.frames_at,
                ring.stamps_at,
                ring.frames,
                ring.samples,
                ring.taken_at,
                lead_s,
            )
            != 0
        ):
            raise PumpUnavailable(f"stream {self.handle} could not be attached to the session's ring")

    def detach(self) -> None:
        self._lib.pump_detach(self.handle)

    def stats(self) -> dict[str, float]:
        if self._final is not None:
            return dict(self._final)
        out = (ctypes.c_double * len(STATS))()
        if self._lib.pump_stats(self.handle, out, len(STATS)) != 0:
            return {}
        return dict(zip(STATS, out, strict=True))

    def __del__(self) -> None:  # a stream dropped without `aclose`: its entry and held frames go with it
        if not self.closed.is_set():
            self._lib.pump_unregister(self.handle)

    async def aclose(self) -> None:
        """Unregister (a frame still in flight is dropped by the callback), then end the native stream."""
        if self.closed.is_set():
            return
        self._final = self.stats()
        self.closed.set()
        self._lib.pump_unregister(self.handle)
        owned = getattr(self, "_owned", None)
        if owned is not None:
            owned.dispose()


CAPTURE_STATS = ("sent", "done", "errors", "slow", "refused")


class TrackCapture:
    """The agent's frames into its track's audio source without Python on their way back: each capture's
    request is made by the native callback's library and its answer taken there
    (agent/audio_in/native/audio_pump.c), where `rtc.AudioSource.capture_frame` builds a request, subscribes a
    queue to the FFI client and waits on the room's loop for the answer. `capture` returns at once; a capture
    the runtime answers more than `slow_s` after it was made is counted slow (`stats`). At most 1024 captures
    of the process are in flight; one never answered (its source closed under it) gives its place up after 30
    s, counted as an error.

    `rate`: the rate of the frames it is handed (default: the source's). Frames at another rate are resampled
    to the source's there too (agent/audio_in/native/resample.c, a streaming polyphase filter), where the
    framework would resample each frame through a request of its own from Python."""

    def __init__(self, lib: ctypes.CDLL, source: Any, slow_s: float, rate: int | None = None) -> None:
        self._lib, self._source = lib, source
        self.handle = int(source._ffi_handle.handle)
        self.rate = source.sample_rate if rate is None else rate
        if lib.pump_source_open(self.handle, slow_s, self.rate, source.sample_rate) != 0:
            raise PumpUnavailable("the agent's track could not be fed natively")
        self.closed = False

    def capture(self, samples: Any) -> bool:
        """int16 mono samples at `rate` into the source's queue; False when refused (counted)."""
        if self.closed or not samples.size:
            return False
        pcm = np.ascontiguousarray(samples, dtype=np.int16)
        return self._lib.pump_capture(self.handle, pcm.ctypes.data, pcm.size, self.rate) >= 0

    async def answered(self, timeout_s: float, every_s: float = 0.001) -> bool:
        """Whether every capture made so far has been answered (its samples are in the source's queue, where
        `clear_queue` reaches them) within `timeout_s`: a capture still on its way lands after a clear made
        meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            n = self.stats()
            if n.get("sent", 0.0) <= n.get("done", 0.0) + n.get("errors", 0.0):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(every_s)

    def stats(self) -> dict[str, float]:
        out = (ctypes.c_double * len(CAPTURE_STATS))()
        if self._lib.pump_capture_stats(self.handle, out, len(CAPTURE_STATS)) != 0:
            return getattr(self, "_final", {})
        return dict(zip(CAPTURE_STATS, out, strict=True))

    def close(self) -> None:
        if not self.closed:
            self._final = self.stats()
            self.closed = True
            self._lib.pump_source_close(self.handle)
