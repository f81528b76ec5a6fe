"""Every hop of a burst's way, in and out, with p50 and p99 per hop: the parts timing.py measures per burst,
the room's own times for the burst's output frame (the playout's arrival and start, which each room logs when
its call closes in echo mode, agent/audio_out/heard.py) and the jitter buffers' means (libwebrtc's NetEQ on
both sides, read over the window). Knows the worker's log lines and the rows of timing.py; nothing of how the
callers or the worker were run.

In: the caller's frame -> the server -> the room's process (the network, the server's forwarding, the room's
jitter buffer, its decoding and its frames' cut; of which the jitter buffer's mean over the last 5 s, as the
room read it at the end: a mean, not the burst's own, so it is listed beside, not taken out) -> the room
writes the frame into the session's shared memory, which is the engine's door: the tick takes it
from there when it starts, so the wait at the door and the wait for the tick are one wait. The step. Out: the
onset's place in the output frame -> the engine hands the frame to the room's process (the shared memory and
the room's loop waking) -> the playout's wait -> the agent's track, the server and the caller's jitter buffer
(of which that buffer's mean).
"""

from __future__ import annotations

import re

import numpy as np

from testkit.stats import percentiles

LINE = re.compile(r"playout frames of (\S+) from (\d+)h (\d+)s ([0-9.]+)ms: ([-0-9w;]+)")
MATCH_S = 0.5  # a burst's output frame reaches its room within this of being handed out, or is left out

HOPS = (
    ("in_caller_to_room", "caller -> server -> room's process"),
    ("in_room_jitter_buffer", "  of which the room's jitter buffer (NetEQ, its late mean)"),
    ("in_door_and_tick", "room's process -> engine's door (shared memory) -> the tick"),
    ("live_step", "the step"),
    ("out_place_in_frame", "the onset's place in the output frame"),
    ("out_engine_to_room", "engine -> room's process"),
    ("out_playout_wait", "the playout's wait"),
    ("out_room_to_caller", "agent track -> server -> caller (with its jitter buffer)"),
)


def room_times(log: str) -> dict[str, np.ndarray]:
    """Each room's kept playout frames, by its label: `[frames, 2]` (arrived, started), by arrival
    (agent/audio_out/heard.py `HeardCounter.close` writes them)."""
    out: dict[str, np.ndarray] = {}
    for line in log.splitlines():
        m = LINE.search(line)
        if m is None:
            continue
        base = int(m.group(2)) * 3600 + int(m.group(3)) + float(m.group(4)) / 1e3
        items = np.asarray([x.split("w") for x in m.group(5).split(";")], np.float64) / 1e4
        arrived = base + np.cumsum(items[:, 0])
        t = np.stack([arrived, arrived + items[:, 1]], axis=1)
        out[m.group(1)] = t[np.argsort(t[:, 0], kind="stable")]
    return out


def split(rows: list[dict], label: str, times: np.ndarray | None, rx_jitter_ms: float | None) -> None:
    """Each of one room's burst rows gets its hops (ms; a hop whose times are missing is left out)."""
    for r in rows:
        r["in_door_and_tick"] = r["inbox_wait"]
        r["out_place_in_frame"] = r["framing_out"]
        r["in_caller_to_room"] = r["transport_in"]
        if rx_jitter_ms:
            r["in_room_jitter_buffer"] = rx_jitter_ms
        if times is None or not times.size or r.get("sent_at") is None:
            continue
        i = int(np.searchsorted(times[:, 0], r["sent_at"]))
        if i >= len(times) or times[i, 0] - r["sent_at"] > MATCH_S:
            continue
        arrived, started = times[i]
        r["out_engine_to_room"] = (arrived - r["sent_at"]) * 1e3
        r["out_playout_wait"] = (started - arrived) * 1e3
        r["out_room_to_caller"] = r["after_engine"] - r["out_engine_to_room"] - r["out_playout_wait"]


def hops(rows: list[dict]) -> dict:
    """p50, p99 and max per hop over the bursts that have it, and how many do."""
    out = {}
    for key, _ in HOPS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = {**percentiles(values), "n": len(values)}
    return out


def report(h: dict, caller_jitter_ms: float | None) -> list[str]:
    lines = ["  every hop, p50 / p99 (ms; bursts timed):"]
    for key, name in HOPS:
        v = h[key]
        if v["n"]:
            lines.append(f"    {name:<62} {v['p50']:>7} / {v['p99']:>7}   ({v['n']})")
    if caller_jitter_ms is not None:
        lines.append(f"      of the last, the caller's jitter buffer (NetEQ), mean: {caller_jitter_ms:g} ms")
    return lines
