"""The latency Chorus adds between a caller and the engine, through a real LiveKit server, in echo mode.

`python -m benchmarks.livekit_latency --callers 16 --seconds 20` starts the worker as a user does
(`python -m agent start`, tiny preset, CPU, one slot per caller) with CHORUS_ECHO=true (engine/echo.py, a
measurement tool): the tick runs as always, but each live session's output frame is its own input frame of
that tick, resampled to 22.05 kHz, so every caller hears itself back through the whole path: WebRTC to the
server and on to the worker, livekit-agents' room input (80 ms frames at 16 kHz), the engine's inbox and tick,
the duplex adapter and its turn gate, the 160 ms playout buffer, the agent's track, back through the server
to the caller.

Each caller is a real participant (the `livekit` rtc SDK) publishing a 48 kHz tone of its own frequency with a
20 ms burst (a 1 kHz tone at 0.7 full scale) about every 0.5 s. A burst's onset is timed four times:
  - leaving the caller (the capture time of its 20 ms frame, plus what the SDK still queued, plus its place
    in the frame);
  - entering the engine: the engine logs every input frame with a sample above `engine.echo.MARK`: when it
    was pushed into the session's inbox, when the tick that consumed it started, when the output frame was
    handed to the session, and where in the frame the onset lies;
  - arriving back at the caller (the arrival of the received frame holding it, less the SDK's frame
    assembly, plus its place in the frame).
All of it on one machine's CLOCK_MONOTONIC (loop.time() here, time.monotonic() in the worker).

Per burst: (a) = the tick that consumed the onset's frame - the onset leaving the caller, split into the input
framing (the rest of the onset's 80 ms frame), transport (client -> server -> worker -> inbox) and the wait in
the inbox for the tick; (b) = the onset arriving at the caller - its output frame handed out, split into its
place in the output frame and what follows (the playout buffer, the agent's track, the server, the caller's
jitter buffer). The echo round trip is (a) + live step + (b). Mouth to ear for the real model adds the model's
own algorithmic delays that echo skips (the perception's lag, the codec's delay); the 80 ms framing, the tick
and the playout buffer are in the measurement as they happened, and are also listed at their nominal values.

Needs the server of scripts/livekit.sh (start_livekit, inside a namespace made by netns_up): the environment's
CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET, or LIVEKIT_URL/_API_KEY/_API_SECRET. The last line is one JSON
object. A benchmark, not a test: it asserts nothing but that bursts came back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from agent.call import room_label  # noqa: E402
from livekit_support import ALLOWED_INTERFACES, Server, Worker, interfaces, token  # noqa: E402

RATE = 48_000  # the callers' tracks, both ways
TONE = 0.05  # each caller's own tone (full scale 1.0): well below the mark, never silence to the engine
BURST = 0.7  # the bursts' level, well above it
BURST_HZ = 1000.0
# a burst's length names it among four (burst i has LENGTHS_S[i % 4]), so that a burst is matched to its own
# echo even when the latency grows past the time between bursts
LENGTHS_S = (0.015, 0.030, 0.045, 0.060)
PERIOD_S = 0.5  # a burst every 0.45 to 0.55 s: its onset falls anywhere in the engine's 80 ms frames
WITHIN_S = 1.5  # a burst's echo is looked for this long after it (its name repeats every 2 s)
JOIN_EVERY_S = 0.25  # one caller joins after another
AGENT_WAIT_S = 90.0  # a caller whose agent is not heard by then is left out of the figures
# a caller this far behind the wall clock skips ahead (as a microphone would) instead of bursting
LATE_S = 0.1
QUIET_S = 0.1  # a received onset follows at least this long without a loud sample
SEND_MS = 40  # audio handed to the SDK at a time (each burst's place in its frame is counted)
RECV_MS = 40  # the agent's audio read in frames of this length (the SDK assembles them from 10 ms pulls)


def server_from_env() -> Server:
    url = os.environ.get("CHORUS_TEST_LIVEKIT_URL") or os.environ.get("LIVEKIT_URL")
    key = os.environ.get("CHORUS_TEST_LIVEKIT_API_KEY") or os.environ.get("LIVEKIT_API_KEY")
    secret = os.environ.get("CHORUS_TEST_LIVEKIT_API_SECRET") or os.environ.get("LIVEKIT_API_SECRET")
    if not (url and key and secret):
        raise SystemExit(
            "livekit_latency: no LiveKit server: set CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET "
            "(scripts/livekit.sh's start_livekit, inside a namespace made by netns_up) "
            "or LIVEKIT_URL/_API_KEY/_API_SECRET"
        )
    leaks = interfaces() - ALLOWED_INTERFACES
    if leaks:
        raise SystemExit(
            f"livekit_latency: this network namespace has interfaces that lead out of it: {sorted(leaks)} "
            "(run it inside one made by scripts/livekit.sh's netns_up)"
        )
    return Server(url, key, secret)


def constants() -> dict:
    """The algorithmic parts, from the code that sets them."""
    from agent.playout_buffer import BUFFER_FRAMES, START_DELAY_FRAMES
    from agent.playout_timing import MAX_START_DELAY_FRAMES, MIN_START_DELAY_S
    from engine.echo import MARK
    from engine.model.codec_ops import cached_columns
    from engine.presets import load_preset

    cfg = load_preset("tiny")  # the 11B preset has the same clock, perception geometry and codec head
    big = load_preset("nemotron-voicechat-11b")
    assert (big.clock, big.codec.n_fft, big.codec.hop_length) == (
        cfg.clock,
        cfg.codec.n_fft,
        cfg.codec.hop_length,
    )
    clock, per, codec = big.clock, big.perception, big.codec
    codec_delay = cached_columns(codec.n_fft, codec.hop_length) // 2 * codec.hop_length  # Codec.output_delay
    return {
        "frame_ms": clock.frame_ms,
        "input_rate": clock.input_rate,
        "input_samples": clock.input_samples,
        "output_rate": clock.output_rate,
        "output_samples": clock.output_samples,
        "tick_ms": clock.frame_ms,  # the tick is the model's frame
        # the encoder runs (chunk_mel - 1) mel columns behind the audio (engine/model/perception.py)
        "perception_lag_ms": (per.chunk_mel - 1) * per.hop_length * 1000 / clock.input_rate,
        "codec_delay_ms": codec_delay * 1000 / clock.output_rate,
        "playout_buffer_ms": BUFFER_FRAMES * clock.frame_ms,
        # a call's first turns; then as the measured jitter needs, within these bounds (ArrivalJitter)
        "playout_start_delay_ms": START_DELAY_FRAMES * clock.frame_ms,
        "playout_start_delay_range_ms": [MIN_START_DELAY_S * 1000, MAX_START_DELAY_FRAMES * clock.frame_ms],
        "mark": MARK,
    }


@dataclass
class Caller:
    """A participant publishing its tone with bursts and recording the agent's audio."""

    server: Server
    room: str
    agent_name: str
    index: int
    rng: np.random.Generator
    tone: float = TONE
    freq: float = 0.0
    # sent: the first sample of each SEND_MS frame, its capture time and the SDK's queue before it
    sent_n: list[int] = field(default_factory=list)
    sent_t: list[float] = field(default_factory=list)
    sent_q: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)  # how late each frame was captured (the loop's load)
    bursts: list[int] = field(default_factory=list)  # sample index of each burst's onset
    skipped_ahead: int = 0  # times the sender fell LATE_S behind and skipped ahead
    heard: list[np.ndarray] = field(default_factory=list)
    heard_t: list[float] = field(default_factory=list)
    agent_joined: asyncio.Event = field(default_factory=asyncio.Event)
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.freq = 330.0 + 45.0 * self.index
        self.jwt = token(self.server, self.room, f"caller-{self.index}", self.agent_name)

    async def join(self) -> None:
        from livekit import rtc

        self.lk = rtc.Room()

        def on_participant(p) -> None:
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                self.agent_joined.set()

        def on_track(track, _pub, _p) -> None:
            if track.kind == rtc.TrackKind.KIND_AUDIO:
                self.tasks.append(asyncio.ensure_future(self._record(track)))

        self.lk.on("participant_connected", on_participant)
        self.lk.on("track_subscribed", on_track)
        await self.lk.connect(self.server.url, self.jwt)
        for p in self.lk.remote_participants.values():
            on_participant(p)
        self.source = rtc.AudioSource(RATE, 1, queue_size_ms=100)
        track = rtc.LocalAudioTrack.create_audio_track("microphone", self.source)
        opts = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        await self.lk.local_participant.publish_track(track, opts)

    async def _record(self, track) -> None:
        from livekit import rtc

        loop = asyncio.get_running_loop()
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1, frame_size_ms=RECV_MS):
            self.heard_t.append(loop.time())
            self.heard.append(np.frombuffer(ev.frame.data, dtype=np.int16).copy())
            self.first_audio.set()

    def _frame(self, n: int, f: int, measuring: bool) -> np.ndarray:
        t = (n + np.arange(f)) / RATE
        x = self.tone * np.sin(2 * np.pi * self.freq * t)
        while measuring and 0 <= self._next < n + f:  # the bursts that begin in this frame
            self.bursts.append(max(self._next, n))
            self._next = self.bursts[-1] + int(PERIOD_S * RATE * self.rng.uniform(0.9, 1.1))
        for i in range(max(0, len(self.bursts) - 2), len(self.bursts)):
            b, length = self.bursts[i], int(LENGTHS_S[i % len(LENGTHS_S)] * RATE)
            lo, hi = max(b, n), min(b + length, n + f)
            if lo < hi:
                j = np.arange(lo, hi)
                x[lo - n : hi - n] += BURST * np.cos(2 * np.pi * BURST_HZ * (j - b) / RATE)
        return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)

    async def send(self, measure: asyncio.Event, stop: asyncio.Event) -> None:
        """Publish in real time on the wall clock; bursts while `measure` is set."""
        from livekit import rtc

        loop = asyncio.get_running_loop()
        f = RATE * SEND_MS // 1000
        t0, n = loop.time(), 0
        self._next = -1
        while not stop.is_set():
            due = t0 + n / RATE
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -LATE_S:
                t0, due = t0 - wait, due - wait
                self.skipped_ahead += 1
            if measure.is_set() and self._next < 0:
                self._next = n + int(self.rng.uniform(0, PERIOD_S) * RATE)
            pcm = self._frame(n, f, measure.is_set())
            now = loop.time()
            self.sent_n.append(n)
            self.sent_t.append(now)
            self.sent_q.append(self.source.queued_duration)
            self.late.append(now - due)
            await self.source.capture_frame(rtc.AudioFrame(pcm.tobytes(), RATE, 1, f))
            n += f

    async def leave(self) -> None:
        with contextlib.suppress(Exception):
            await self.lk.disconnect()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # -- analysis ---------------------------------------------------------------------------------------

    def leave_times(self) -> np.ndarray:
        """When each burst's onset left this caller (monotonic seconds)."""
        starts = np.asarray(self.sent_n)
        k = np.searchsorted(starts, np.asarray(self.bursts), side="right") - 1
        return (
            np.asarray(self.sent_t)[k]
            + np.asarray(self.sent_q)[k]
            + (np.asarray(self.bursts) - starts[k]) / RATE
        )

    def heard_onsets(self, mark: float) -> tuple[np.ndarray, np.ndarray]:
        """When each burst's onset reached this caller, and which burst it is. The SDK hands over RECV_MS
        frames assembled from 10 ms pulls of the jitter buffer, so a frame's first sample arrived
        RECV_MS - 10 ms before the frame."""
        if not self.heard:
            return np.zeros(0), np.zeros(0, np.int64)
        audio = np.concatenate(self.heard).astype(np.float32) / 32768
        sizes = np.array([h.size for h in self.heard])
        first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        loud = np.flatnonzero(np.abs(audio) > mark)
        if not loud.size:
            return np.zeros(0), np.zeros(0, np.int64)
        onsets = loud[np.concatenate([[True], np.diff(loud) > QUIET_S * RATE])]
        span = int((max(LENGTHS_S) + 0.02) * RATE)
        names = np.array(
            [
                burst_name(
                    int((np.abs(audio[m : m + span]) > mark).sum()),
                    float(np.abs(audio[m : m + span]).max()),
                    RATE,
                    mark,
                )
                for m in onsets
            ]
        )
        j = np.searchsorted(first, onsets, side="right") - 1
        self._audio, self._onsets = audio, onsets
        return np.asarray(self.heard_t)[j] - (RECV_MS - 10) / 1000 + (onsets - first[j]) / RATE, names

    def tone_check(self) -> dict:
        """The tone this caller hears between bursts (its own?), and how continuous it is: 10 ms blocks of the
        echoed audio quieter than a third of the tone, over the measurement."""
        audio, onsets = getattr(self, "_audio", None), getattr(self, "_onsets", None)
        if audio is None or onsets is None or onsets.size < 2:
            return {"freq_hz": None, "own_tone": False, "quiet_blocks": None, "longest_quiet_ms": None}
        seg = audio[onsets[0] + int(0.05 * RATE) : onsets[0] + int(0.40 * RATE)]
        spec = np.abs(np.fft.rfft(seg * np.hanning(seg.size)))
        freq = float(np.argmax(spec) * RATE / seg.size)
        span = audio[onsets[0] : onsets[-1]]
        block = RATE // 100
        rms = np.sqrt(np.mean(span[: span.size // block * block].reshape(-1, block) ** 2, axis=1))
        quiet = rms < self.tone / np.sqrt(2) / 3
        longest, run = 0, 0
        for q in quiet:
            run = run + 1 if q else 0
            longest = max(longest, run)
        return {
            "freq_hz": round(freq, 1),
            "own_tone": abs(freq - self.freq) < 10,
            "quiet_blocks": int(quiet.sum()),
            "blocks": int(quiet.size),
            "longest_quiet_ms": 10 * longest,
        }


def burst_name(loud: int, peak: float, rate: int, mark: float) -> int:
    """Which of LENGTHS_S a burst is, from how many of its samples are above the mark: a cosine of amplitude A
    is above `mark` for 1 - 2/pi asin(mark / A) of its samples."""
    share = 1 - 2 / np.pi * np.arcsin(min(1.0, mark / max(peak, 1e-9)))
    length = loud / rate / max(share, 1e-9)
    return int(np.argmin([abs(length - x) for x in LENGTHS_S]))


def engine_onsets(frames: list[dict], label: str, rate: int, mark: float) -> list[dict]:
    """The engine's marked frames of one room as bursts: the first frame of each run of consecutive ticks (a
    burst can straddle two frames), with the burst's name from the whole run."""
    shown = room_label(label)  # the worker shows a room by its label, a pseudonym of its name
    mine = sorted((r for r in frames if r["label"] == shown), key=lambda r: r["tick"])
    runs: list[list[dict]] = []
    for r in mine:
        if runs and r["tick"] == runs[-1][-1]["tick"] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return [
        {**run[0], "name": burst_name(sum(r["loud"] for r in run), max(r["peak"] for r in run), rate, mark)}
        for run in runs
    ]


def match(caller: Caller, frames: list[dict], k: dict) -> tuple[list[dict], dict]:
    """Per burst: its onset's four times and the parts between them (ms); bursts with a missing time left out.
    A burst is matched to the first engine frame and then the first echo of its own name (LENGTHS_S) after it,
    within WITHIN_S."""
    left = caller.leave_times()
    eng = engine_onsets(frames, caller.room, k["input_rate"], k["mark"])
    heard, names = caller.heard_onsets(k["mark"])
    used_e, used_h = set(), set()
    rows = []
    fin = k["input_samples"] / k["input_rate"]
    for i, t_send in enumerate(left):
        name = i % len(LENGTHS_S)
        e = next(
            (
                j
                for j, r in enumerate(eng)
                if j not in used_e
                and r["name"] == name
                and r["pushed"] is not None
                and t_send < r["pushed"] < t_send + WITHIN_S
            ),
            None,
        )
        if e is None:
            continue
        used_e.add(e)
        e = eng[e]
        h = next(
            (
                j
                for j, t in enumerate(heard)
                if j not in used_h and names[j] == name and e["sent"] < t < e["sent"] + WITHIN_S
            ),
            None,
        )
        if h is None:
            continue
        used_h.add(h)
        ear = heard[h]
        pos = e["onset"] / k["input_rate"]  # the onset's place in its frame (also in the output frame)
        rows.append(
            {
                "framing_in": (fin - pos) * 1e3,
                "transport_in": (e["pushed"] - t_send - (fin - pos)) * 1e3,
                "inbox_wait": (e["tick_start"] - e["pushed"]) * 1e3,
                "live_step": (e["sent"] - e["tick_start"]) * 1e3,
                "framing_out": pos * 1e3,
                "after_engine": (ear - e["sent"] - pos) * 1e3,
                "a": (e["tick_start"] - t_send) * 1e3,
                "b": (ear - e["sent"]) * 1e3,
                "round_trip": (ear - t_send) * 1e3,
                "onset": e["onset"],
                "backlog": e["backlog"],
                "left_at": round(float(t_send), 4),
            }
        )
    seen = {"sent": len(left), "in_engine": len(eng), "heard": len(heard), "engine_matched": len(used_e)}
    return rows, seen


def write_dump(folder: Path, callers: list[Caller], matched: list, engine: dict) -> None:
    """Each timed burst's parts (bursts.json), the engine's log, and each caller's received audio (WAV)."""
    import wave

    folder.mkdir(parents=True, exist_ok=True)
    bursts = [{"room": c.room, **r} for c, (rows, _) in zip(callers, matched, strict=True) for r in rows]
    (folder / "bursts.json").write_text(json.dumps({"bursts": bursts, "engine_frames": engine["frames"]}))
    for c in callers:
        with wave.open(str(folder / f"{c.room}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(np.concatenate(c.heard).tobytes() if c.heard else b"")


def pcts(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    v = np.asarray(values, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(v, 50)), 1),
        "p99": round(float(np.percentile(v, 99)), 1),
        "max": round(float(v.max()), 1),
    }


def other_workers(mine: int) -> int:
    """Other `python -m agent start` processes on this machine (someone else's worker sharing the CPUs)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == mine:
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            n += b"agent" in cmd and b"start" in cmd and b"-m" in cmd
    return n


def cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle and iowait), total


async def session(
    server: Server, worker: Worker, n: int, seconds: float, seed: int, tone: float
) -> tuple[list[Caller], dict]:
    rng = np.random.default_rng(seed)
    tag = uuid.uuid4().hex[:6]
    callers = [
        Caller(
            server,
            f"lat-{tag}-{i:02d}",
            worker.agent_name,
            i,
            np.random.default_rng(rng.integers(1 << 31)),
            tone,
        )
        for i in range(n)
    ]
    measure, stop = asyncio.Event(), asyncio.Event()
    everyone = callers

    async def join(c: Caller, i: int) -> None:
        await asyncio.sleep(JOIN_EVERY_S * i)  # callers arrive one after another, as they do
        await c.join()

    await asyncio.gather(*(join(c, i) for i, c in enumerate(callers)))
    senders: list[asyncio.Future] = []
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.first_audio.wait() for c in callers)), AGENT_WAIT_S)
        callers = [c for c in everyone if c.first_audio.is_set()]
        if len(callers) < len(everyone):
            missing = [(c.room, c.agent_joined.is_set()) for c in everyone if not c.first_audio.is_set()]
            print(
                f"livekit_latency: no agent audio within {AGENT_WAIT_S:.0f} s in (room, agent joined): "
                f"{missing}; measuring the other {len(callers)}",
                file=sys.stderr,
            )
        if not callers:
            raise SystemExit("livekit_latency: no caller heard its agent")
        senders = [asyncio.ensure_future(c.send(measure, stop)) for c in callers]
        rooms = {c.room for c in callers}
        shown = {room_label(r) for r in rooms}  # as the worker names them: by their labels
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        # every session live in the engine (prompt prefilled, held audio replayed)
        while loop.time() < deadline:
            snap = await asyncio.to_thread(worker.snapshot)
            live = {s["label"] for s in snap["sessions"] if s["phase"] == "live"}
            if shown <= live:
                break
            await asyncio.sleep(0.25)
        else:
            raise SystemExit(f"livekit_latency: sessions not live within 60 s: {sorted(shown - live)}")
        await asyncio.sleep(1.0)
        before = await asyncio.to_thread(worker.snapshot)
        cpu0, load0, others0 = cpu_times(), os.getloadavg(), other_workers(worker.proc.pid)
        measure.set()
        await asyncio.sleep(seconds)
        measure.clear()
        for c in callers:
            c._next = -1
        await asyncio.sleep(1.5)  # the last bursts' echoes
        cpu1, load1, others1 = cpu_times(), os.getloadavg(), other_workers(worker.proc.pid)
        snap = await asyncio.to_thread(worker.snapshot)
    finally:
        stop.set()
        await asyncio.gather(*senders, return_exceptions=True)
        await asyncio.gather(*(c.leave() for c in everyone))
    ours = [s for s in snap["sessions"] if s["label"] in shown]
    engine = {
        "ticks": snap["ticks"] - before["ticks"],
        "live_ms_p50": snap["live_ms_p50"],
        "live_ms_p99": snap["live_ms_p99"],
        "missed_deadlines": snap["missed_deadlines"] - before["missed_deadlines"],
        "slipped_ticks": snap["slipped_ticks"] - before["slipped_ticks"],
        "underruns": sum(s["underruns"] for s in ours),
        # what the buffers cost over each call (engine/api.py SessionSnapshot): the caller audio the model
        # missed for want of a frame, and the gaps in the agent's audio at the playout
        "underrun_s": round(sum(s.get("underrun_s", 0.0) for s in ours), 2),
        "playout_gaps": sum(s.get("playout_gaps", 0) for s in ours),
        "playout_gap_s": round(sum(s.get("playout_gap_s", 0.0) for s in ours), 3),
        "tick_shift_ms": snap.get("tick_shift_ms", 0.0),
        "skipped_frames": sum(s["skipped_frames"] for s in ours),
        "dropped_frames": sum(s["dropped_frames"] for s in ours),
        "frames": snap["echo"]["frames"] if snap.get("echo") else [],
        "cpu_busy": round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3),
        "cpus": os.cpu_count(),
        "loadavg_1m": [round(load0[0], 2), round(load1[0], 2)],
        "other_workers": [others0, others1],  # other Chorus workers running at the start and the end
    }
    if not snap.get("echo"):
        raise SystemExit("livekit_latency: the worker's snapshot has no echo log: is CHORUS_ECHO honoured?")
    return callers, engine


def run(
    n: int, seconds: float, seed: int, tone: float, tmp: Path, dump: Path | None = None, fixed: bool = False
) -> dict:
    """One measurement with a fresh worker (`fixed`: the fixed-buffer baseline, CHORUS_FIXED_BUFFERS)."""
    server = server_from_env()
    k = constants()
    os.environ["CHORUS_DATA_DIR"] = str(tmp)
    import datetime as dt

    from tools.seed import seed as seed_hotel
    from tools.store import open_store

    with open_store() as store:
        seed_hotel(store, dt.date.today())
    worker = Worker(server, tmp, slots=n, CHORUS_ECHO="true", CHORUS_FIXED_BUFFERS=str(fixed).lower())
    worker.env.pop("CHORUS_TEACHER_FORCING", None)  # echo replaces whatever the model says: nothing to script
    with worker:
        try:
            callers, engine = asyncio.run(session(server, worker, n, seconds, seed, tone))
        except BaseException:
            print(f"the worker's log, last lines:\n{worker.tail(30)}", file=sys.stderr)
            raise
        finally:
            if dump is not None:
                dump.mkdir(parents=True, exist_ok=True)
                (dump / "worker.log").write_bytes(worker.log.read_bytes())
        gated = worker.log.read_text(errors="replace").count("echo mode:")
    matched = [match(c, engine["frames"], k) for c in callers]
    if dump is not None:
        write_dump(dump, callers, matched, engine)
    rows = [r for m in matched for r in m[0]]
    counts = {
        key: sum(m[1][key] for m in matched) for key in ("sent", "in_engine", "heard", "engine_matched")
    }
    sent = sum(len(c.bursts) for c in callers)
    parts = [
        "a",
        "framing_in",
        "transport_in",
        "inbox_wait",
        "live_step",
        "b",
        "framing_out",
        "after_engine",
        "round_trip",
    ]
    fig = {p: pcts([r[p] for r in rows]) for p in parts}
    model_ms = k["perception_lag_ms"] + k["codec_delay_ms"]
    fig["mouth_to_ear"] = pcts([r["round_trip"] + model_ms for r in rows])
    tones = [c.tone_check() for c in callers]
    late = np.concatenate([np.asarray(c.late) for c in callers]) * 1e3
    onsets = np.array([r["onset"] for r in rows])
    return {
        "callers": n,
        "callers_heard": len(callers),
        "seconds": seconds,
        "tone": tone,
        "bursts_sent": sent,
        "bursts_timed": len(rows),
        # sent; marked bursts the engine saw; onsets the callers heard; sent bursts found in the engine
        "bursts": counts,
        "figures_ms": fig,
        "algorithmic_ms": {
            "input_framing": k["frame_ms"],  # framing_in + framing_out of every sample
            "tick_wait_max": k["tick_ms"],  # measured: inbox_wait
            "perception_lag": round(k["perception_lag_ms"], 2),  # the model's, not in echo
            "codec_delay": round(k["codec_delay_ms"], 2),  # the model's, not in echo
            "playout_buffer_max": k["playout_buffer_ms"],  # measured: inside after_engine
            "playout_start_delay": k["playout_start_delay_ms"],
            "playout_start_delay_range": k["playout_start_delay_range_ms"],
        },
        "engine": {key: v for key, v in engine.items() if key != "frames"},
        "echo_log_warning": gated > 0,
        "own_tone_heard": sum(t["own_tone"] for t in tones),
        "quiet_blocks": sum(t["quiet_blocks"] or 0 for t in tones),
        "blocks": sum(t.get("blocks", 0) for t in tones),
        "longest_quiet_ms": max((t["longest_quiet_ms"] or 0) for t in tones),
        "onset_spread": [int(onsets.min()), int(onsets.max())] if onsets.size else None,
        "inbox_backlog_max": int(max((r["backlog"] for r in rows), default=0)),
        "sender_late_ms": pcts(list(late)),
        "sender_skipped_ahead": sum(c.skipped_ahead for c in callers),
    }


def report(res: dict) -> None:
    f, a = res["figures_ms"], res["algorithmic_ms"]
    eng = res["engine"]

    def line(name: str, key: str) -> str:
        v = {q: "-" if x is None else x for q, x in f[key].items()}
        return f"  {name:<54} p50 {v['p50']:>7} ms   p99 {v['p99']:>7} ms   max {v['max']:>7} ms"

    print(
        f"{res['callers']} caller(s), {res['seconds']:g} s: "
        f"{res['bursts_timed']} of {res['bursts_sent']} bursts timed"
    )
    print(line("(a) leaving the caller -> the tick that consumed it", "a"))
    print(line("    input framing (rest of its 80 ms frame)", "framing_in"))
    print(line("    transport: caller -> server -> worker -> inbox", "transport_in"))
    print(line("    waiting in the inbox for the tick", "inbox_wait"))
    print(line("live step (tick start -> output frame handed out)", "live_step"))
    print(line("(b) output frame handed out -> arriving at the caller", "b"))
    print(line("    its place in the output frame", "framing_out"))
    print(line("    playout buffer, agent track, server, caller jitter buf", "after_engine"))
    print(line("echo round trip (a + live step + b)", "round_trip"))
    print(
        line(
            f"mouth to ear (+ perception {a['perception_lag']} + codec {a['codec_delay']} ms)", "mouth_to_ear"
        )
    )
    print(
        f"  algorithmic parts: input framing {a['input_framing']} ms (in a + b), "
        f"tick wait 0-{a['tick_wait_max']:g} ms (inbox wait), perception lag {a['perception_lag']} ms, "
        f"codec {a['codec_delay']} ms (the model's; not in echo), "
        f"playout buffer up to {a['playout_buffer_max']:g} ms (a turn's first frame waits "
        f"{a['playout_start_delay']:g} ms at first, then {a['playout_start_delay_range'][0]:g}-"
        f"{a['playout_start_delay_range'][1]:g} ms as the measured jitter needs; in b)"
    )
    print(
        f"  engine: live step p50 {eng['live_ms_p50']} ms p99 {eng['live_ms_p99']} ms, missed deadlines "
        f"{eng['missed_deadlines']}, slipped ticks {eng['slipped_ticks']}, underruns {eng['underruns']}, "
        f"skipped {eng['skipped_frames']}, dropped {eng['dropped_frames']}"
    )
    print(
        f"  buffers: underrun time {eng['underrun_s']} s, playout gaps {eng['playout_gaps']} "
        f"({eng['playout_gap_s']} s), the tick moved {eng['tick_shift_ms']} ms toward the arrivals"
    )
    print(
        f"  echo flow: {res['own_tone_heard']} of {res['callers']} callers hear their own tone; "
        f"10 ms blocks without it {res['quiet_blocks']} of {res['blocks']} "
        f"(longest {res['longest_quiet_ms']} ms)"
    )
    print(
        f"  machine: {eng['cpus']} CPUs {eng['cpu_busy'] * 100:.0f}% busy, load average {eng['loadavg_1m']}, "
        f"other workers {eng['other_workers']}; "
        f"callers' frames captured late p50 {res['sender_late_ms']['p50']} "
        f"p99 {res['sender_late_ms']['p99']} ms"
        f" (skipped ahead {res['sender_skipped_ahead']} times)"
    )
    b = res["bursts"]
    print(
        f"  bursts: {b['sent']} sent, {b['in_engine']} seen by the engine ({b['engine_matched']} matched), "
        f"{b['heard']} heard back, {res['bursts_timed']} timed end to end"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.livekit_latency", description=__doc__.splitlines()[0]
    )
    p.add_argument("--callers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=20.0, help="bursts are sent for this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tone",
        type=float,
        default=TONE,
        help="the callers' tone between bursts (full scale 1); below 0.004 the engine takes it for silence, "
        "which it may shed when a session falls behind",
    )
    p.add_argument(
        "--dump", type=Path, default=None, help="a folder for each burst's times and what callers heard"
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="then the same with the fixed buffers (CHORUS_FIXED_BUFFERS): the buffers before they followed "
        "the measured jitter",
    )
    p.add_argument(
        "--busy", type=int, default=0, help="processes that each keep a core busy for the whole measurement"
    )
    args = p.parse_args()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.busy)
    ]
    results = {}
    try:
        for fixed in (False, True) if args.baseline else (False,):
            with tempfile.TemporaryDirectory(prefix="chorus-lk-latency-") as tmp:
                t0 = time.monotonic()
                res = run(args.callers, args.seconds, args.seed, args.tone, Path(tmp), args.dump, fixed)
                res["wall_s"] = round(time.monotonic() - t0, 1)
                res["busy_processes"] = args.busy
            print("fixed buffers (the baseline):" if fixed else "buffers that follow the measured jitter:")
            report(res)
            results["fixed" if fixed else "adaptive"] = res
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    if args.baseline:
        a, f = results["adaptive"], results["fixed"]
        print(
            "adaptive against fixed: mouth to ear p50 / p99 "
            f"{a['figures_ms']['mouth_to_ear']['p50']} / {a['figures_ms']['mouth_to_ear']['p99']} ms against "
            f"{f['figures_ms']['mouth_to_ear']['p50']} / {f['figures_ms']['mouth_to_ear']['p99']} ms; "
            f"underrun time {a['engine']['underrun_s']} s against {f['engine']['underrun_s']} s; "
            f"playout gaps {a['engine']['playout_gap_s']} s against {f['engine']['playout_gap_s']} s"
        )
        print(json.dumps(results))
        return 0 if a["bursts_timed"] and f["bursts_timed"] else 1
    print(json.dumps(results["adaptive"]))
    return 0 if results["adaptive"]["bursts_timed"] else 1


if __name__ == "__main__":
    sys.exit(main())
