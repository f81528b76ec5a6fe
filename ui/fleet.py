"""The workers the page watches: their snapshots fetched over HTTP, the fleet's totals, and the page's tables
as plain rows (personal data masked). Knows the engine's snapshot model and HTTP; nothing of Streamlit."""

from __future__ import annotations

import datetime as dt
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import ValidationError

from engine.api import EngineSnapshot
from redaction import redact
from ui.privacy import mask_phones, shorten
from ui.trace_links import trace_link

STATES = {
    "prompt": "prefilling prompt",
    "live": "live",
    "tool_call": "calling a tool",
    "waiting": "waiting",
    "prefill": "prefilling",
    "replay": "replaying",
}
LAST_WORDS_SHOWN = 48  # characters of the agent's last words on the page
TOOL_LOG_ROWS = 10


@dataclass
class Worker:
    """One worker as last fetched: its snapshot, or why there is none."""

    url: str
    snapshot: EngineSnapshot | None
    error: str | None = None
    fetched_at: float = 0.0  # wall-clock time of the fetch

    @property
    def name(self) -> str:
        parts = urlsplit(self.url)
        return parts.netloc or self.url

    @property
    def up(self) -> bool:
        return self.snapshot is not None


def fetch(url: str, timeout_s: float) -> Worker:
    """The worker's snapshot, or a Worker with a one-line `error` (never raises)."""
    now = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = r.read()
        return Worker(url, EngineSnapshot.model_validate_json(body), fetched_at=now)
    except urllib.error.HTTPError as e:
        error = f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        error = str(e.reason)
    except TimeoutError:
        error = f"no answer within {timeout_s:g} s"
    except ValidationError:
        error = "the answer is not an engine snapshot"
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    return Worker(url, None, error, now)


def fetch_all(urls: list[str], timeout_s: float) -> list[Worker]:
    """Every worker at once (a slow one costs at most `timeout_s`), in the order of `urls`."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(urls)), thread_name_prefix="monitor-fetch") as pool:
        return list(pool.map(lambda u: fetch(u, timeout_s), urls))


@dataclass(frozen=True)
class Totals:
    workers: int
    workers_up: int
    rooms: int
    slots: int
    free_slots: int
    worst_p99_ms: float
    missed_deadlines: int
    dropped_frames: int
    underruns: int
    tool_calls: int
    redispatches: int  # new agents for rooms whose agent was lost or never came (agent/fleet/fleet.py)


def totals(workers: list[Worker]) -> Totals:
    """The fleet's figures over the workers that answered."""
    snaps = [w.snapshot for w in workers if w.snapshot is not None]
    rooms = sum(len(s.sessions) for s in snaps)
    slots = sum(s.num_slots for s in snaps)
    return Totals(
        workers=len(workers),
        workers_up=len(snaps),
        rooms=rooms,
        slots=slots,
        free_slots=slots - rooms,
        worst_p99_ms=max((s.live_ms_p99 for s in snaps), default=0.0),
        missed_deadlines=sum(s.missed_deadlines for s in snaps),
        dropped_frames=sum(s.dropped_frames for s in snaps),
        underruns=sum(s.underruns for s in snaps),
        tool_calls=sum(s.tool_calls for s in snaps),
        redispatches=sum(sum(s.redispatches.values()) for s in snaps),
    )


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def ms(value: float) -> str:
    """A duration in milliseconds as the page shows it: one decimal below 100 ms, none above."""
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def memory(snap: EngineSnapshot) -> str:
    """The memory in use (CUDA: allocated on the device; CPU: the process's resident memory)."""
    return f"{snap.memory_bytes / 1024**3:.1f} GiB" if snap.memory_bytes else "n/a"


def memory_help(snap: EngineSnapshot) -> str:
    what = "allocated on the device" if snap.device.startswith("cuda") else "resident memory of the process"
    total = f" of {snap.memory_total_bytes / 1024**3:.0f} GiB" if snap.memory_total_bytes else ""
    return f"{what}{total}"


def session_rows(workers: list[Worker], trace_url: str = "") -> list[dict]:
    """One row per open session on the workers that answered: room, caller, state, duration, counters (the
    agent's turns, the words of its turn) and, when a worker sends them (CHORUS_SHOW_WORDS=redacted), the
    agent's last words (redacted again, whatever the worker did, and shortened); with a `trace_url` template,
    the link to each session's trace ("" for one without)."""
    rows = []
    many = len(workers) > 1
    words = any(w.snapshot is not None and w.snapshot.show_words != "off" for w in workers)
    for w in workers:
        if w.snapshot is None:
            continue
        for s in sorted(w.snapshot.sessions, key=lambda s: (s.label, s.slot)):
            state = STATES.get(s.phase, s.phase)
            if s.phase == "live" and s.speaking:
                state = "live, talking"
            row = {"worker": w.name} if many else {}
            row |= {
                "room": mask_phones(s.label) or s.id,
                "caller": s.caller or "?",
                "state": state,
                "tool": ", ".join(s.calling),
                "duration": duration(s.age_s),
                "heard (ms)": "" if s.heard_ms is None else f"{s.heard_ms:.0f}",
                "rx buffer (ms)": f"{s.rx_jitter_ms:.0f}" if s.rx_jitter_ms else "",
                "inbox reserve": s.reserve_frames,
                "playout (ms)": f"{s.playout_ms:.0f}",
                "start delay (ms)": f"{s.start_delay_ms:.0f}",
                "turn start (ms)": "" if s.turn_start_ms is None else f"{s.turn_start_ms:.0f}",
                "underruns": f"{s.underruns} ({s.underrun_s:g} s)",
                "gaps": f"{s.playout_gaps} ({s.playout_gap_s:.2f} s)",
                "tool calls": s.tool_calls,
                "turns": s.turns,
                "words": s.turn_words,
            }
            if words:
                row["last words"] = shorten(redact(s.last_words), LAST_WORDS_SHOWN)
            if trace_url:  # the call's trace in the operator's trace store (ui/trace_links.py)
                row["trace"] = trace_link(trace_url, s.trace_id)
            rows.append(row)
    return rows


def tool_log_rows(workers: list[Worker], limit: int = TOOL_LOG_ROWS) -> list[dict]:
    """The latest finished tool calls over the workers that answered, newest first."""
    calls = [(w, c) for w in workers if w.snapshot is not None for c in w.snapshot.tool_log]
    calls.sort(key=lambda wc: wc[1].at, reverse=True)
    many = len(workers) > 1
    rows = []
    for w, c in calls[:limit]:
        row = {"time": dt.datetime.fromtimestamp(c.at).strftime("%H:%M:%S")}
        if many:
            row["worker"] = w.name
        row |= {
            "room": mask_phones(c.label) or c.session,
            "tools": ", ".join(c.names) or "(unreadable call)",
            "ok": c.ok,
            "model ms": c.call_ms,
            "tool ms": c.tool_ms,
            "resume ms": c.resume_ms,
        }
        rows.append(row)
    return rows


def tick_series(workers: list[Worker]) -> dict[str, list[tuple[float, float]]]:
    """The live step over the last minutes, per series name: (seconds ago, ms) points, oldest first. One
    worker gives its per-second max and median; several give each worker's max."""
    series: dict[str, list[tuple[float, float]]] = {}
    many = len(workers) > 1
    for w in workers:
        s = w.snapshot
        if s is None:
            continue
        step = s.history_step_s
        kinds = (
            [("max", s.history_max_ms)] if many else [("max", s.history_max_ms), ("median", s.history_p50_ms)]
        )
        for kind, values in kinds:
            name = f"{w.name} {kind}" if many else f"{kind} per {step:.2g} s"
            n = len(values)
            series[name] = [(round(-(n - 1 - i) * step, 2), v) for i, v in enumerate(values)]
    return series
