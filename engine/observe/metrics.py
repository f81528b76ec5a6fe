"""Engine accounting: tick times, deadlines, frames, tool latencies; Prometheus metrics and
the snapshot's endpoint.

The snapshot's model, `EngineSnapshot`, is in `engine/api.py` (the page reads it without this module). The
HTTP endpoint (`SnapshotServer`) serves it at `/snapshot`, Prometheus text at `/metrics` and `/healthz`, on
127.0.0.1 by default, from a process of its own; each is built here at most twice a second whatever the
requests. Knows numbers and sessions' public counters; knows nothing of the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel

from engine.observe.snapshot_serve import ServeLimits
from engine.transport.link import PLAYOUT_FIELDS, check_playout

log = logging.getLogger("chorus.metrics")


class HeardPlan(Protocol):
    """What `record_heard` reads of the tick's live plan (engine/tick/plan.py `LivePlan`): one row a slot."""

    arrived: np.ndarray  # [S] float64: when the row's frame arrived (NaN: no frame)
    reset: np.ndarray  # [S] bool: rows returned to a fresh state before the step


# the live step and the tick (ms): 2.5 ms apart where a CPU's tick falls, so percentiles read from them hold
TICK_BUCKETS_MS = (
    *(5, 7.5, 10, 12.5, 15, 17.5, 20, 22.5, 25, 30, 35, 40, 50, 60, 70, 80),
    *(100, 150, 250, 500, 1000),
)
# a caller frame's arrival to its output frame handed out (inbox wait + live step)
HEARD_BUCKETS_MS = np.array([10, 20, 40, 60, 80, 100, 120, 160, 200, 300, 500, 1000], dtype=np.float64)
# a wait longer than an hour, or one that ended before the frame arrived, is a room's wrong write time (its
# shared memory, engine/transport/link.py), not a wait: left out and counted
HEARD_MAX_MS = 3_600_000.0


@dataclass(frozen=True)
class Figures:
    """What the engine's open sessions and counters say at a scrape (`engine/observe/snapshot.py`
    `figures`)."""

    heard: np.ndarray  # histogram counts of HEARD_BUCKETS_MS, the last for beyond them
    heard_sum_ms: float
    underruns: int
    tick_s: float
    dropped: int
    slots: list[int]  # per open session: its slot,
    reserve: list[int]  # its inbox's reserve,
    playout: np.ndarray  # [sessions, len(PLAYOUT_FIELDS)]: its room's playout as checked (NaN: rejected)
    rejected: int  # values read from rooms' shared memory and left out (`SharedReads`, `Accounting`)
    redispatches: dict[str, int]  # the worker's new agents for rooms alone, by reason (agent/fleet/fleet.py)


class _FiguresCollector:
    """Prometheus figures read from the engine at scrape time (on the metrics thread, never the tick):
    the latency histogram the tick fills with array adds, the underruns and dropped frames, the values of
    rooms' shared memory left out, and per slot the inbox's reserve and the room's playout (what was
    plausible of it)."""

    source: Callable[[], Figures] | None = None  # the process's engine (the newest one made)

    def collect(self):
        source = type(self).source
        f = source() if source is not None else None
        if f is None:
            return
        cum = np.cumsum(f.heard)
        buckets = [(str(b / 1000), float(c)) for b, c in zip(HEARD_BUCKETS_MS, cum[:-1], strict=True)]
        yield HistogramMetricFamily(
            "chorus_heard_seconds",
            "A caller frame's arrival to its output frame handed out (inbox wait and live step)",
            buckets=[*buckets, ("+Inf", float(cum[-1]))],
            sum_value=f.heard_sum_ms / 1000,
        )
        yield CounterMetricFamily(
            "chorus_underruns", "Live ticks with no caller frame (silence fed)", f.underruns
        )
        yield CounterMetricFamily(
            "chorus_underrun_seconds",
            "Caller audio the model missed for want of a frame",
            f.underruns * f.tick_s,
        )
        yield CounterMetricFamily(
            "chorus_dropped_frames", "Input frames dropped from a full inbox", f.dropped
        )
        yield CounterMetricFamily(
            "chorus_shared_memory_rejected",
            "Values rooms wrote to their shared memory that were not plausible (left out of every figure)",
            f.rejected,
        )
        family = CounterMetricFamily(
            "chorus_redispatches",
            "Rooms with a caller and no live agent for which the worker asked for a new agent",
            labels=["reason"],
        )
        for reason, n in sorted(f.redispatches.items()):
            family.add_metric([reason], n)
        yield family
        per_slot = {
            "chorus_inbox_reserve_frames": "Caller frames held after the tick took its own",
            "chorus_playout_queued_seconds": "The agent's audio queued ahead of the caller's ear",
            "chorus_playout_gaps": "Gaps in the agent's audio this call (a frame came after the last ended)",
            "chorus_playout_gap_seconds": "The length of those gaps, this call",
            "chorus_playout_start_delay_seconds": "What a turn's first frame waits (the measured jitter)",
            "chorus_playout_late_absorbed": "The agent's frames that came late but played without a gap",
            "chorus_receive_jitter_buffer_seconds": "Caller audio in WebRTC's jitter buffer, mean lately",
            "chorus_receive_concealed_seconds": "Caller audio WebRTC concealed this call (lost or late)",
        }
        families = {name: GaugeMetricFamily(name, doc, labels=["slot"]) for name, doc in per_slot.items()}
        shown = [i for i, field in enumerate(PLAYOUT_FIELDS) if field != "turn_played_at"]
        for slot, reserve, playout in zip(f.slots, f.reserve, f.playout[:, shown].tolist(), strict=True):
            for name, value in zip(per_slot, (reserve, *playout), strict=True):
                if value == value:  # a rejected value (NaN) is left out
                    families[name].add_metric([str(slot)], float(value))
        yield from families.values()


def publish(source: Callable[[], Figures]) -> None:
    """The figures `/metrics` reads at a scrape come from `source` (the process's newest engine)."""
    _Prom.get()
    _FiguresCollector.source = source


class _Prom:
    """Process-wide Prometheus metrics (one worker process, one engine; registered once)."""

    _lock = threading.Lock()
    _made = None

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._made is None:
                cls._made = {
                    "live": Histogram(
                        "chorus_live_step_seconds",
                        "Duration of the live step of a tick",
                        buckets=[b / 1000 for b in TICK_BUCKETS_MS],
                    ),
                    "tick": Histogram(
                        "chorus_tick_seconds",
                        "Duration of a whole tick (live step and paused work)",
                        buckets=[b / 1000 for b in TICK_BUCKETS_MS],
                    ),
                    "missed": Counter("chorus_missed_deadlines", "Ticks whose frames were late"),
                    "overruns": Counter("chorus_overruns", "Ticks whose work ran past the deadline"),
                    "slipped": Counter(
                        "chorus_slipped_ticks", "Ticks skipped by a clock more than a tick behind"
                    ),
                    "tool_calls": Counter("chorus_tool_calls", "Tool calls started by the model"),
                    "tool_call": Histogram(
                        "chorus_tool_call_seconds", "Tool-call start to function calls emitted"
                    ),
                    "resume": Histogram("chorus_tool_resume_seconds", "Last tool result to live again"),
                    "sessions": Gauge("chorus_sessions", "Open sessions"),
                    "occupancy": Gauge("chorus_occupancy", "Share of slots in use"),
                }
                REGISTRY.register(_FiguresCollector())
            return cls._made


class Accounting:
    """Counters and recent history kept by the tick thread; read from any thread."""

    def __init__(self, window: int = 4096, recent: int = 100) -> None:
        self.prom = _Prom.get()
        self.tick_ms: deque[float] = deque(maxlen=window)
        self.live_ms: deque[float] = deque(maxlen=window)
        self.tool_call_ms: deque[float] = deque(maxlen=window)
        self.tool_call_ticks: deque[int] = deque(maxlen=window)
        self.resume_ms: deque[float] = deque(maxlen=window)
        self.ticks = 0
        self.recent_missed: deque[bool] = deque(maxlen=recent)
        self.missed_deadlines = 0
        self.overruns = 0
        self.owed: dict[str, int] = {}  # pieces of paused work run past the slack, by kind
        self.slipped_ticks = 0
        self.early_ticks = 0  # ticks started before their time, their frames all in (engine.py `_loop`)
        self.early_s = 0.0  # ...and by how much in all
        self.closed_dropped = 0  # frame counters of sessions already closed
        self.closed_skipped = 0
        self.tool_calls = 0
        # per slot, the last live frame's arrival -> its output handed out; all of them as histogram counts
        self.heard_ms = np.zeros(0)
        self.heard_counts = np.zeros(HEARD_BUCKETS_MS.size + 1, dtype=np.int64)
        self.heard_sum_ms = 0.0
        self.rejected_times = 0  # rooms' frame write times that made no wait (HEARD_MAX_MS), left out
        self.shared = SharedReads()  # the rooms' playout figures, checked where they are read

    def record_tick(self, live_ms: float, tick_ms: float, missed: bool, overran: bool = False) -> None:
        self.ticks += 1
        self.live_ms.append(live_ms)
        self.tick_ms.append(tick_ms)
        self.recent_missed.append(missed)
        self.prom["live"].observe(live_ms / 1000)
        self.prom["tick"].observe(tick_ms / 1000)
        if missed:
            self.missed_deadlines += 1
            self.prom["missed"].inc()
        if overran:
            self.overruns += 1
            self.prom["overruns"].inc()

    def record_heard(self, plan: HeardPlan, rows: np.ndarray, t: float) -> None:
        """The live step's frames were handed out at `t`: how long the frame of each of `rows` (the live rows
        whose output is heard) had waited since it arrived, in array operations over the rows."""
        if self.heard_ms.size != plan.arrived.size:
            self.heard_ms = np.full(plan.arrived.size, np.nan)
        self.heard_ms[plan.reset] = np.nan
        heard = (t - plan.arrived) * 1e3
        ok = rows & (heard >= 0) & (heard <= HEARD_MAX_MS)  # False for NaN: no frame
        wrong = rows & ~ok & ~np.isnan(heard)  # a time that is not a wait (a NaN one reads as no frame)
        if wrong.any():
            self.heard_ms[wrong] = np.nan
            self.rejected_times += int(np.count_nonzero(wrong))
        if not ok.any():
            return
        got = heard[ok]
        self.heard_ms[ok] = got
        np.add.at(self.heard_counts, np.searchsorted(HEARD_BUCKETS_MS, got, side="left"), 1)
        self.heard_sum_ms += float(got.sum())

    def record_slip(self, ticks: int) -> None:
        self.slipped_ticks += ticks
        self.prom["slipped"].inc(ticks)

    def record_early(self, s: float) -> None:
        self.early_ticks += 1
        self.early_s += s

    def record_call(self, call_ms: float, ticks: int) -> None:
        self.tool_calls += 1
        self.tool_call_ms.append(call_ms)
        self.tool_call_ticks.append(ticks)
        self.prom["tool_calls"].inc()
        self.prom["tool_call"].observe(call_ms / 1000)

    def record_resume(self, resume_ms: float) -> None:
        self.resume_ms.append(resume_ms)
        self.prom["resume"].observe(resume_ms / 1000)


class SharedReads:
    """The rooms' playout figures (engine/transport/link.py `check_playout`) as the snapshot and `/metrics`
    read them, on their callers' threads, never the tick's. A value found implausible is counted once, where
    it was read, and again only when its room writes another in its place."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, np.ndarray] = {}  # an open session -> its playout's bytes as last read
        self.rejected = 0

    def read(self, ids: list[str], playouts: list[np.ndarray], now: float) -> np.ndarray:
        """The playout of each session of `ids` (`playouts`: views of their memory, each copied once here),
        checked at `now` (CLOCK_MONOTONIC): `[sessions, len(PLAYOUT_FIELDS)]`, NaN where rejected."""
        raw = np.array(playouts, np.float64).reshape(len(ids), len(PLAYOUT_FIELDS))
        checked, bad = check_playout(raw, now)
        bits = raw.view(np.int64)
        with self._lock:
            if bad.any():
                for k in np.flatnonzero(bad.any(axis=1)).tolist():  # sessions with a rejected value
                    last = self._last.get(ids[k])
                    self.rejected += int(
                        np.count_nonzero(bad[k] if last is None else bad[k] & (bits[k] != last))
                    )
            self._last = dict(zip(ids, bits, strict=True))
        return checked


def pct(values, q: float) -> float:
    v = list(values)
    return round(float(np.percentile(v, q)), 3) if v else 0.0


def history(values, per: int) -> tuple[list[float], list[float]]:
    """The max and the median of each run of `per` values (oldest first; an incomplete oldest run
    is left out)."""
    v = np.fromiter(values, dtype=np.float64)
    n = v.size // per * per
    if n == 0:
        return [], []
    runs = v[v.size - n :].reshape(-1, per)
    return np.round(runs.max(axis=1), 2).tolist(), np.round(np.median(runs, axis=1), 2).tolist()


class SnapshotServer:
    """Serves `/snapshot` (the JSON of `snapshot()`), `/metrics` (Prometheus text) and `/healthz` over HTTP.

    Every thread of this process shares the tick thread's GIL, and a request served in it would take the GIL
    from the tick many times (its parsing, its snapshot, its serialisation, each of its socket calls; the tick
    wants it back after every tensor op). So the HTTP side runs in a small process of its own
    (engine/observe/snapshot_serve.py), at a lower CPU priority, which asks this one for the bytes of an
    answer over a pipe at most once per `interval_s` for each kind. Here one thread ("chorus-metrics") waits
    on that pipe and builds what is asked for: `snapshot()` holds no lock the tick waits on, and nothing else
    of a request reaches this process. The other process answers exact paths only (anything else 404), GET and
    HEAD, one request per connection; it closes a connection that has not sent its whole request within
    `head_s` or taken its answer within `timeout_s`, keeps at most `client_connections` open per client
    address and `max_connections` in all (one more takes the place of the oldest that has not sent its
    request, or is closed at once if every one has), answers at most `max_rate` requests a second, and gives
    each client address `client_rate` requests a second (429 beyond)."""

    def __init__(
        self,
        snapshot: Callable[[], BaseModel],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServeLimits | None = None,
    ) -> None:
        self.limits = limits or ServeLimits()
        self._make = {
            b"s": lambda: snapshot().model_dump_json().encode(),
            b"m": lambda: generate_latest(REGISTRY),
        }
        self.builds = {"snapshot": 0, "metrics": 0}  # answers built for the other process, by kind
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("snapshot_serve.py")),
                self.limits.to_json(),
                host,
                str(port),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.process.wait()
            raise OSError(f"the snapshot endpoint cannot listen on {host}:{port} (its error is above)")
        self.port = int(line)
        self._closed = False
        self.thread = threading.Thread(target=self._build, name="chorus-metrics", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        """Answer the other process's questions until it is gone: one byte in, one frame out."""
        ask, tell = self.process.stdout, self.process.stdin
        while kind := ask.read(1):
            try:
                body, ok = self._make[kind](), b"1"
            except Exception:  # the engine could not describe itself: the request gets a 500, serving goes on
                log.exception("the %s answer could not be built", "snapshot" if kind == b"s" else "metrics")
                body, ok = b"", b"0"
            self.builds["snapshot" if kind == b"s" else "metrics"] += 1
            try:
                tell.write(kind + ok + len(body).to_bytes(4, "big") + body)
                tell.flush()
            except (OSError, ValueError):  # closed under us
                return

    def close(self) -> None:
        """Stop serving: the other process exits once its pipe is closed (killed if it has not within 5 s).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.thread.join(timeout=5)
        self.process.stdout.close()


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux /proc; 0 where it is not available)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
