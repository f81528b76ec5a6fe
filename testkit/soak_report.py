"""The soak's report (benchmarks/soak.py) of what testkit/soak_sampler.py sampled: its 5-minute windows, its
totals, and the checks at the end (memory flat, no slot kept after a hang-up, slots never above the calls
live, no caller left silent, the database against the calls). The PNG is testkit/soak_plot.py's.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from agent.forcing import REPLY_EVERY_S
from agent.settings import AgentSettings
from testkit.soak_calls import CallRecord, read_only
from testkit.soak_sampler import HANDOVER_OVERLAP_S, LEAVE_GRACE_S, ROOM, Recorder
from testkit.stats import percentiles

SILENCE_BOUND_S = 5.0  # [fleet]'s bound: a caller hears an agent again within 5 s of losing theirs
HANDOVER_GAP_S = 1.5  # ... and a drain's: from the draining agent leaving to the new one's voice
# a new agent's first words: prompts/resumed_greeting.md (a resumed call), handover_greeting.md (handed over)
ACKNOWLEDGED = ("sorry, we were", "thank you for holding")
FIRST_TURN_S = 8.0  # a new agent's first turn is said whole this long after its first words
MEMORY_PER_HOUR = 0.05  # a process's resident memory after its warm-up: within 5% per hour (5% at least)
NOT_JUDGED = ("generator",)  # the callers' side: its memory is the live calls' audio, kept for the checks
# LiveKit's server and its Redis, not Chorus's: their heaps (Go's collector, Redis's allocator) swing by more
# than 5% over a few minutes, so they are judged only over spans this long (the hour, not CI's 3 minutes)
THEIRS, THEIRS_SPAN_S = ("server", "redis"), 600.0
WARM_ROOMS = AgentSettings.model_fields["warm_rooms"].default  # room processes a worker keeps waiting
ROOMS_JUDGED = 10  # room processes after the warm-up needed to judge them as one series
EDGE_S = 60.0  # memory is compared between the first and the last minute after the warm-up


def _spread(v: list[float]) -> dict:
    return {"n": len(v), **percentiles(v)}


def _counter(samples: list[dict], key: str) -> dict[int, float]:
    """Per worker, how much an engine counter grew over `samples` (an engine started again counts from 0)."""
    out: dict[int, float] = defaultdict(float)
    last: dict[int, float] = {}
    for s in samples:
        for pid, e in s["engines"].items():
            v = e[key]
            prev = last.get(pid, 0.0)
            out[pid] += v - prev if v >= prev else v
            last[pid] = v
    return out


def windows(rec: Recorder, records: list[CallRecord], window_s: float) -> list[dict]:
    out = []
    end = rec.samples[-1]["t"] if rec.samples else 0.0
    a = 0.0
    while a < end:
        b = a + window_s
        inside = [s for s in rec.samples if a <= s["t"] < b]
        before = [s for s in rec.samples if s["t"] < a][-1:]
        joined = [r for r in records if r.joined_at is not None and a <= r.joined_at - rec.t0 < b]
        ended = [r for r in records if r.left_at is not None and a <= r.left_at - rec.t0 < b]
        names = sorted({n for s in inside for n in s["procs"] if not n.startswith(ROOM)})
        rooms = [(n, p) for s in inside for n, p in s["procs"].items() if n.startswith(ROOM)]
        out.append(
            {
                "from_s": a,
                "answered": sum(r.answered_at is not None for r in joined),
                "refused": sum(r.answered_at is None for r in joined),
                "resumed": sum(r.hit_at is not None and a <= r.hit_at - rec.t0 < b for r in records),
                "longest_silence_s": round(
                    max((r.longest_unasked(0.0) for r in ended if r.answered_at), default=0.0), 2
                ),
                "longest_unasked_silence_s": round(
                    max((r.longest_unasked(REPLY_EVERY_S) for r in ended if r.answered_at), default=0.0), 2
                ),
                "m2e_ms": _spread([x for s in inside for x in s["m2e_ms"]]),
                "missed_deadlines": int(
                    sum(_counter(before + inside, "missed").values())
                    - sum(_counter(before, "missed").values())
                ),
                "live_max": max((s["live"] for s in inside), default=0),
                "slots_max": max((s["slots"] for s in inside), default=0),
                "leaked_max": max((s["leaked"] for s in inside), default=0),
                "rss_mb": {
                    n: round(float(np.mean([s["procs"][n]["rss_mb"] for s in inside if n in s["procs"]])), 1)
                    for n in names
                },
                "fds_max": {n: max(s["procs"][n]["fds"] for s in inside if n in s["procs"]) for n in names},
                "threads_max": {
                    n: max(s["procs"][n]["threads"] for s in inside if n in s["procs"]) for n in names
                },
                # the rooms' own processes (one a call, and those waiting for their callers)
                "room_processes": {
                    "max_at_once": max(
                        (sum(n.startswith(ROOM) for n in s["procs"]) for s in inside), default=0
                    ),
                    "rss_max_mb": max((p["rss_mb"] for _, p in rooms), default=0.0),
                    "fds_max": max((p["fds"] for _, p in rooms), default=0),
                    "threads_max": max((p["threads"] for _, p in rooms), default=0),
                },
                "rows": inside[-1]["rows"] if inside else {},
            }
        )
        a = b
    return out


def memory_growth(rec: Recorder, warmup_s: float) -> dict[str, dict]:
    """Per process that lived past its warm-up by at least two edges (EDGE_S, or half the warm-up if shorter):
    its resident memory's mean over the last edge against the first edge after the warm-up, and the growth
    allowed over that span."""
    edge = min(EDGE_S, warmup_s / 2)
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in rec.samples:
        for n, p in s["procs"].items():
            series[n].append((s["t"], p["rss_mb"]))
    out = {}
    for n, pts in series.items():
        if n in NOT_JUDGED or n.startswith(ROOM):
            continue
        start = pts[0][0] + warmup_s
        after = [(t, v) for t, v in pts if t >= start]
        if not after or after[-1][0] - after[0][0] < (THEIRS_SPAN_S if n in THEIRS else 2 * edge):
            continue
        first = np.mean([v for t, v in after if t < after[0][0] + edge])
        last = np.mean([v for t, v in after if t > after[-1][0] - edge])
        span_h = (after[-1][0] - after[0][0]) / 3600
        out[n] = {
            "from_mb": round(float(first), 1),
            "to_mb": round(float(last), 1),
            "growth_pct": round(float((last - first) / first * 100), 2),
            "allowed_pct": round(MEMORY_PER_HOUR * 100 * max(1.0, span_h), 2),
            "span_min": round(float(span_h) * 60, 1),
        }
    start = min((p[0][0] for p in series.values()), default=0.0)
    end = max((p[-1][0] for p in series.values()), default=0.0)
    rooms = room_growth(series, start + warmup_s, end)
    if rooms is not None:
        out["room processes"] = rooms
    return out


def room_growth(series: dict[str, list[tuple[float, float]]], after_s: float, end_s: float) -> dict | None:
    """The rooms' own processes, each one call's (and gone with it), judged as one series: each one's peak
    resident memory against when it started, for those started after the warm-up and gone before the end
    (those left wait for their callers). A line fitted through
    them gives the growth from the first to the last, which must stay within MEMORY_PER_HOUR as a long-lived
    process's (a forkserver or a worker that grew would show here); None with fewer than ROOMS_JUDGED."""
    peaks = sorted(
        (pts[0][0], max(v for _, v in pts))
        for n, pts in series.items()
        if n.startswith(ROOM) and pts[0][0] >= after_s and pts[-1][0] < end_s
    )
    if len(peaks) < ROOMS_JUDGED or peaks[-1][0] - peaks[0][0] < 2 * EDGE_S:
        return None
    t = np.asarray([p[0] for p in peaks])
    v = np.asarray([p[1] for p in peaks])
    slope, at0 = np.polyfit(t, v, 1)
    first, last = at0 + slope * t[0], at0 + slope * t[-1]
    span_h = (t[-1] - t[0]) / 3600
    return {
        "from_mb": round(float(first), 1),
        "to_mb": round(float(last), 1),
        "growth_pct": round(float((last - first) / first * 100), 2),
        "allowed_pct": round(MEMORY_PER_HOUR * 100 * max(1.0, span_h), 2),
        "span_min": round(float(span_h) * 60, 1),
        "processes": len(peaks),
        "peak_mb": _spread(v.tolist()),
    }


def after_fault(r: CallRecord) -> dict | None:
    """For a call a fault hit: the new agents heard after it, and the caller's silence it made: to the new
    agent's first words from the fault (a SIGKILL), or from the draining agent leaving (a drain). None for a
    call that hung up, or lost its own network, before it could hear one."""
    if r.hit_at is None or r.left_at is None:
        return None
    bound = HANDOVER_GAP_S if r.hit_by == "drain" else SILENCE_BOUND_S
    until = r.hit_again_at if r.hit_again_at is not None else math.inf  # a second fault's agents are its own
    # the agents there before the fault: the room's first (heard or not: one killed before it spoke) and any
    # heard before it; the others heard before the next fault are the new ones
    before = {r.first_agent} | {a for a, t in r.speech_at.items() if t <= r.hit_at}
    new = {a: t for a, t in r.speech_at.items() if r.hit_at < t < until and a not in before}
    since = r.hit_at
    if r.hit_by == "drain":
        old = [t for t in r.agent_left_at.values() if r.hit_at < t < until]
        since = min(old) if old else r.left_at
    if not new and (
        r.left_at < since + bound or any(a < since + bound and b > r.hit_at for a, b in r.outages)
    ):
        return None
    first_new = min(new, key=new.get) if new else None
    words = r.said.get(first_new, "").lower() if first_new else ""
    # a turn of the earlier agent was whole before the fault: there was a conversation to carry on (none, and
    # the new agent greets the caller as the first would have)
    carried = any(a not in new and at < r.hit_at for a, at in r.turns_at)
    return {
        "new_agents": len(new),
        # its first turn heard whole (the caller stayed on through it): did it acknowledge the break?
        "acknowledged": None
        if first_new is None or not carried or r.left_at < new[first_new] + FIRST_TURN_S
        else any(a in words for a in ACKNOWLEDGED),
        "goodbye": any("goodbye" in t.lower() for t in r.said.values()),
        "silence_s": round((min(new.values()) if new else r.left_at) - since, 2),
        "bound_s": bound,
    }


def check(rec: Recorder, records: list[CallRecord], store_dir: Path, warmup_s: float) -> dict[str, dict]:
    final = rec.samples[-1]
    mem = memory_growth(rec, warmup_s)
    grown = {n: m for n, m in mem.items() if m["growth_pct"] > m["allowed_pct"]}
    leaked = [(s["t"], s["leaked"]) for s in rec.samples if s["leaked"]]
    over = [(s["t"], s["excess"]) for s in rec.samples if s.get("excess")]
    most = max((s["slots"] - s["live"] for s in rec.samples), default=0)
    answered = [r for r in records if r.answered_at is not None]
    loud = {r.plan.i: round(r.longest_unasked(REPLY_EVERY_S), 1) for r in answered}
    silent = {i: s for i, s in loud.items() if s > SILENCE_BOUND_S}
    faulted = {r.plan.i: (r.hit_by, got) for r in records if (got := after_fault(r)) is not None}
    long = {
        i: v for i, v in faulted.items() if v[1]["silence_s"] > v[1]["bound_s"] or v[1]["new_agents"] != 1
    }
    unsaid = {i: v for i, v in faulted.items() if v[1]["acknowledged"] is False or v[1]["goodbye"]}
    at_end = Counter(n.split()[1].split(".")[0] for n in final["procs"] if n.startswith(ROOM))
    kept = {w: n for w, n in at_end.items() if n > WARM_ROOMS}
    db = _db(store_dir)
    booking = [r for r in records if r.plan.kind == "booking" and r.guest]
    twice = {r.guest: db["by_guest"].get(r.guest, 0) for r in booking if db["by_guest"].get(r.guest, 0) > 1}
    lost = [r.plan.i for r in booking if r.reached and db["by_guest"].get(r.guest, 0) != 1]
    taken = [r.plan.i for r in records if r.plan.kind == "taken" and db["by_guest"].get(r.guest, 0)]
    cancels = [r for r in records if r.plan.kind == "cancel" and r.code]
    unapplied = [r.plan.i for r in cancels if r.reached and db["status"].get(r.code) != "cancelled"]
    return {
        "every call answered": {
            "ok": len(answered) == len(records) and not any(r.error for r in records),
            "detail": f"{len(answered)} of {len(records)} answered, "
            f"{sum(bool(r.error) for r in records)} failed on the caller's side",
        },
        "memory flat after warm-up": {
            "ok": not grown and bool(mem),
            "detail": f"{len(mem)} processes judged; grown past the bound: {grown or 'none'}",
        },
        "no slot kept after a hang-up": {
            "ok": not leaked,
            "detail": f"samples with a slot held for a call that ended over {LEAVE_GRACE_S:g} s before: "
            f"{leaked[:5] or 'none'}",
        },
        "no room's process outlives its call": {
            "ok": not kept,
            "detail": f"room processes at the end, per worker: {dict(at_end) or 'none'} "
            f"(up to {WARM_ROOMS} wait for their callers)",
        },
        "slots in use never above calls live": {
            "ok": not over,
            "detail": f"most slots above calls live in a sample: {most} (a handover holds two for one call, "
            f"up to {HANDOVER_OVERLAP_S:g} s; a hung-up call's is let go within {LEAVE_GRACE_S:g} s); "
            f"samples with slots beyond that: {over[:5] or 'none'}",
        },
        "no slot in use at the end": {
            "ok": final["slots"] == 0,
            "detail": f"{final['slots']} slots in use {final['t']:.0f} s in",
        },
        "no caller left silent": {
            "ok": not silent,
            "detail": f"longest unasked silence over {len(loud)} calls: "
            f"{max(loud.values(), default=0.0)} s (bound {SILENCE_BOUND_S:g} s); over it: {silent or 'none'}",
        },
        "a fault's callers hear one new agent in time": {
            "ok": not long and len(faulted) > 0,
            "detail": f"{len(faulted)} calls hit, silence after the fault "
            f"{sorted(v[1]['silence_s'] for v in faulted.values())} s (bound {SILENCE_BOUND_S:g} s, "
            f"a drain's {HANDOVER_GAP_S:g} s); over it or not one new agent: {long or 'none'}",
        },
        "a fault's callers hear the conversation carried on": {
            "ok": not unsaid,
            "detail": f"{sum(v[1]['acknowledged'] is not None for v in faulted.values())} new agents' first "
            f"turns heard whole; without acknowledging the break, or with a goodbye: {unsaid or 'none'}",
        },
        "each booking made once": {
            "ok": not twice and not lost,
            "detail": f"{sum(r.reached for r in booking)} of {len(booking)} booking calls reached their "
            f"result; "
            f"made twice: {twice or 'none'}; reached but not made once: {lost or 'none'}",
        },
        "a sold-out room is not booked": {
            "ok": not taken,
            "detail": f"{sum(r.plan.kind == 'taken' for r in records)} calls asked; "
            f"booked: {taken or 'none'}",
        },
        "no room held without its booking": {
            "ok": not db["holds"],
            "detail": "nights whose booked count differs from the confirmed bookings: "
            f"{db['holds'][:5] or 'none'}",
        },
        "every cancellation applied": {
            "ok": not unapplied,
            "detail": f"{sum(r.reached for r in cancels)} of {len(cancels)} cancel calls reached their "
            f"result; "
            f"not applied: {unapplied or 'none'}",
        },
        "no conversation left": {
            "ok": db["conversations"] == 0,
            "detail": f"{db['conversations']} conversations kept after every call ended"
            + (f": {'; '.join(db.get('kept', []))}" if db["conversations"] else ""),
        },
    }


def _db(store_dir: Path) -> dict:
    path = store_dir / "hotel.sqlite3"
    with read_only(path) as db:
        by_guest = dict(db.execute("SELECT guest_name, count(*) FROM reservations GROUP BY guest_name"))
        status = dict(db.execute("SELECT code, status FROM reservations"))
        stays = db.execute(
            "SELECT room_type, check_in, check_out FROM reservations WHERE status = 'confirmed'"
        ).fetchall()
        nights = db.execute("SELECT room_type, night, booked FROM inventory WHERE booked > 0").fetchall()
        kept = db.execute("SELECT room_sid, state, updated_at FROM conversations").fetchall()
        everything = db.execute("SELECT room_type, night FROM inventory").fetchall()
    import datetime as dt

    want: dict[tuple[str, str], int] = defaultdict(int)
    for room_type, a, b in stays:
        d, end = dt.date.fromisoformat(a), dt.date.fromisoformat(b)
        while d < end:
            want[(room_type, d.isoformat())] += 1
            d += dt.timedelta(days=1)
    have = {(t, n): b for t, n, b in nights}
    known = set(map(tuple, everything))
    holds = sorted(k for k in set(want) | set(have) if want.get(k, 0) != have.get(k, 0) and k in known)
    found = {"by_guest": by_guest, "status": status, "holds": holds}
    return {**found, "conversations": len(kept), "kept": _kept(kept)}


def _kept(rows: list[tuple]) -> list[str]:
    """Each conversation left: its room's sid, first job, breaks, turns and tool results, and when it was last
    written (no words of it), to find its calls in the workers' logs."""
    out = []
    for sid, state, at in rows[:10]:
        try:
            c = json.loads(state)
            what = f"job {c.get('key')}, {c.get('breaks', 0)} breaks, {len(c.get('said', []))} turns, "
            what += f"{len(c.get('tools', []))} results"
        except (ValueError, AttributeError):
            what = "unreadable"
        out.append(f"room {sid} ({what}; written {at})")
    return out


def totals(rec: Recorder, records: list[CallRecord]) -> dict:
    """The run's totals for its JSON line: calls by kind and outcome, silences, mouth to ear, deadlines."""
    ended = [r for r in records if r.answered_at is not None]
    silences = [r.longest_unasked(REPLY_EVERY_S) for r in ended]
    missed = _counter(rec.samples, "missed")
    return {
        "calls": len(records),
        "by_kind": dict(sorted(Counter(r.plan.kind for r in records).items())),
        "answered": len(ended),
        "refused": sum(r.answered_at is None for r in records),
        "resumed": sum(len(r.agents) > 1 for r in records),
        "after_fault_s": {
            k: _spread([a["silence_s"] for r in records if r.hit_by == k and (a := after_fault(r))])
            for k in sorted({r.hit_by for r in records if r.hit_by})
        },
        "hit": [
            {
                "label": r.label,
                "fault": r.hit_by,
                "at_s": round(r.hit_at - rec.t0, 1),
                "new_agents": (after_fault(r) or {}).get("new_agents"),
            }
            for r in records
            if r.hit_at is not None
        ],
        "hit_by_faults": sum(r.hit_at is not None for r in records),
        "dropped_networks": sum(bool(r.outages) for r in records),
        "hung_up_mid_turn": sum(r.mid_turn for r in records),
        "call_errors": [f"{r.plan.i} {r.plan.kind}: {r.error}" for r in records if r.error],
        "longest_silence_s": _spread([r.longest_unasked(0.0) for r in ended]),
        "unasked_silence_s": _spread(silences),
        "m2e_ms": _spread([x for s in rec.samples for x in s["m2e_ms"]]),
        "missed_deadlines": int(sum(missed.values())),
        "ticks": int(sum(_counter(rec.samples, "ticks").values())),
    }
