"""A room's shared memory (engine/transport/link.py) is the room's to write, so nothing in it is trusted:
whatever a room writes there (infinities, NaN, 1e308, negative figures, a time far in the future), the
engine's `/snapshot` answers 200 with strict JSON, `/metrics` holds only finite values, the other sessions'
figures are as they were, and what was not plausible is left out and counted (`shared_memory_rejected`,
`chorus_shared_memory_rejected_total`). Rooms are wired as engine/door/host.py wires them (a `RoomConn`
pulling the caller ring, the playout read from the same memory); ticks are driven by hand on a ManualClock.
"""

from __future__ import annotations

import json
import math
import os
import socket

import numpy as np
import pytest

from engine.api import EngineSnapshot
from engine.door.host_conn import RoomConn
from engine.observe.metrics import ServeLimits, SnapshotServer
from engine.transport.link import PLAYOUT_FIELDS, Layout, SessionLink
from engine_support import caller_audio, engine_on, run_ticks
from test_snapshot_server import request
from testkit.concierge import PROMPT, TOOLS

FRAME = 1280
# every request is answered from a snapshot built for it, and none refused for its rate
FRESH = ServeLimits(interval_s=0.0, client_rate=1e4, client_burst=10_000, max_rate=1e4)
# where each playout figure shows in a session's snapshot row, what it shows when left out, and its gauge
SHOWN = {
    "queued_s": ("playout_ms", 0.0, "chorus_playout_queued_seconds"),
    "gaps": ("playout_gaps", 0, "chorus_playout_gaps"),
    "gap_s": ("playout_gap_s", 0.0, "chorus_playout_gap_seconds"),
    "start_delay_s": ("start_delay_ms", 0.0, "chorus_playout_start_delay_seconds"),
    "turn_played_at": ("turn_start_ms", None, None),
    "late_absorbed": ("late_absorbed", 0, "chorus_playout_late_absorbed"),
    "rx_jitter_s": ("rx_jitter_ms", 0.0, "chorus_receive_jitter_buffer_seconds"),
    "rx_concealed_s": ("rx_concealed_s", 0.0, "chorus_receive_concealed_seconds"),
}
HOSTILE = (math.inf, -math.inf, math.nan, 1e308, 1e9, -1.0, -1e-300)


def strict_json(body: bytes) -> dict:
    """The JSON of `body`, refusing NaN and Infinity (which JSON has not)."""

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(body, parse_constant=refuse)


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text by its name and labels; a value that is not finite fails."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert math.isfinite(float(value)), line
            out[name] = float(value)
    return out


class Rooms:
    """A tiny engine with three sessions in a turn: two rooms of other processes (their caller frames and
    playout figures in shared memory, as engine/door/host.py wires them), `good` and `bad`, and `local` (a
    room of the engine's own process, its playout in the session); the snapshot endpoint over it."""

    def __init__(self) -> None:
        self.engine = e = engine_on(num_slots=4)
        clock = e.model_cfg.clock
        self.links, self.conns, self.written = {}, {}, {}
        self.sockets = []
        handles = {}
        for name in ("good", "bad"):
            link = SessionLink.create(Layout(clock.input_samples, clock.output_samples))
            near, far = socket.socketpair()
            self.sockets += [near, far]
            conn = RoomConn(near, {"lost_frames": 0, "bad_counters": 0}, lambda conn, msg: None)
            conn.link, conn.efd = link, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            handles[name] = e.open_session(
                PROMPT, TOOLS, sink=conn.deliver, source=conn.pull, pending=conn.pending, playout=link.playout
            )
            self.links[name], self.conns[name], self.written[name] = link, conn, 0
        handles["local"] = e.open_session(PROMPT, TOOLS)
        self.handles = handles
        self.audio = caller_audio(1, 2.0)
        self.k = 0
        self.tick(8)  # prompts prefilled: live
        tok = e.tokens
        for h in handles.values():
            h.force_text([tok.bos] + [tok.pad] * 400)
        self.tick(2)
        self.started = {name: self.session(name).turn.started_at for name in handles}
        assert all(math.isfinite(t) for t in self.started.values()), self.started
        self.server = SnapshotServer(e.snapshot, limits=FRESH)

    def session(self, name: str):
        return self.engine.pool.sessions[self.handles[name].slot]

    def frame(self) -> np.ndarray:
        i = self.k % (self.audio.size // FRAME)
        return self.audio[i * FRAME : (i + 1) * FRAME]

    def tick(self, n: int = 1, bad_at: float | None = None) -> None:
        """`n` ticks, each with a caller frame from every room before it, written at the engine's now (the
        bad room's at `bad_at` when given)."""
        for _ in range(n):
            now = self.engine.clock()
            pcm = (self.frame() * 32767).astype(np.int16)
            for name, link in self.links.items():
                at = bad_at if name == "bad" and bad_at is not None else now
                assert link.put_caller(self.written[name], pcm, at)
                self.written[name] += 1
            self.handles["local"].push_audio(self.frame())
            self.k = run_ticks(self.engine, self.k, 1)

    def plausible(self, name: str) -> np.ndarray:
        """What a room's playout says of itself: 120 ms queued, 2 gaps (50 ms), a 20 ms start delay, the
        turn's first sample played 42 ms after its tick, 5 late frames absorbed, 45 ms in WebRTC's jitter
        buffer, 0.3 s concealed."""
        return np.array([0.12, 2, 0.05, 0.02, self.started[name] + 0.042, 5, 0.045, 0.3])

    def set_playout(self, name: str, values: np.ndarray) -> None:
        if name == "local":
            self.handles[name].report_playout(*values[:6])
            self.handles[name].report_receive(*values[6:])
        else:
            self.links[name].playout[:] = values

    def get(self, path: str) -> bytes:
        status, _, body = request(self.server.port, path)
        assert status == 200, (path, status, body[:200])
        return body

    def snapshot(self) -> tuple[EngineSnapshot, dict[str, dict]]:
        snap = EngineSnapshot.model_validate(strict_json(self.get("/snapshot")))
        by_id = {s.id: s.model_dump() for s in snap.sessions}
        return snap, {name: by_id[h.id] for name, h in self.handles.items()}

    def metrics(self) -> dict[str, float]:
        return samples(self.get("/metrics").decode())

    def close(self) -> None:
        self.server.close()
        self.engine.close()
        for s in self.sockets:
            s.close()
        for conn in self.conns.values():
            os.close(conn.efd)


@pytest.fixture(scope="module")
def rooms():
    r = Rooms()
    yield r
    r.close()


def gauges(values: dict[str, float], slot: int) -> dict[str, float]:
    label = f'{{slot="{slot}"}}'
    return {name.split("{")[0]: v for name, v in values.items() if name.endswith(label)}


def test_implausible_playout_figures_are_left_out_and_counted(rooms):
    for name in rooms.handles:
        rooms.set_playout(name, rooms.plausible(name))
    base, rows = rooms.snapshot()
    assert base.shared_memory_rejected == 0  # plausible figures, and fresh sessions' zeros, are no rejection
    for row in rows.values():
        assert (row["playout_ms"], row["playout_gaps"], row["turn_start_ms"], row["rx_concealed_s"]) == (
            120.0,
            2,
            42.0,
            0.3,
        )
    slots = {name: rows[name]["slot"] for name in rows}
    base_gauges = {name: gauges(rooms.metrics(), slot) for name, slot in slots.items()}
    assert base_gauges["bad"]["chorus_playout_queued_seconds"] == 0.12
    counted = 0
    for i, field in enumerate(PLAYOUT_FIELDS):
        key, left_out, gauge = SHOWN[field]
        now = rooms.engine.clock()
        hostile = HOSTILE + ((now + 5.0, now + 3600.0) if field == "turn_played_at" else ())
        for value in hostile:
            written = rooms.plausible("bad")
            written[i] = value
            rooms.set_playout("bad", written)
            snap, got = rooms.snapshot()  # 200, strict JSON, a valid EngineSnapshot
            case = f"{field}={value!r}: {got['bad']}"
            assert got["good"] == rows["good"] and got["local"] == rows["local"], case
            assert got["bad"] == rows["bad"] | {key: left_out}, case
            assert snap.shared_memory_rejected > counted, case
            counted = snap.shared_memory_rejected
            values = rooms.metrics()  # finite values only
            assert values["chorus_shared_memory_rejected_total"] == counted, case
            for name, slot in slots.items():
                want = base_gauges[name]
                if name == "bad" and gauge is not None:
                    want = {g: v for g, v in want.items() if g != gauge}
                assert gauges(values, slot) == want, (name, case)
            # read again, the same value is not counted again
            assert rooms.snapshot()[0].shared_memory_rejected == counted, case
    rooms.set_playout("bad", rooms.plausible("bad"))
    assert rooms.snapshot()[1] == rows


def test_a_rooms_implausible_frame_times_are_no_wait(rooms):
    """The caller frames' write times a room gives make the engine's `heard` figures (the frame's wait from
    arrival to output): one that makes no wait (later than the frame was heard, not finite, or an absurd age)
    is left out of `heard_ms` and the `chorus_heard_seconds` histogram, and counted; NaN reads as no time."""
    rooms.tick()
    snap, rows = rooms.snapshot()
    counted, heard_ms = snap.shared_memory_rejected, rows["bad"]["heard_ms"]
    assert heard_ms is not None
    before = rooms.metrics()
    now = rooms.engine.clock()
    wrong = (math.inf, -math.inf, 1e300, -1e300, now + 3600.0, now + 1.0, -1e6)
    for at in (math.nan, *wrong):
        rooms.tick(bad_at=at)
        snap, rows = rooms.snapshot()
        assert rows["good"]["heard_ms"] == rows["local"]["heard_ms"] == heard_ms, at  # written at now
        # a NaN time reads as no frame's: the last frame's wait stays
        assert rows["bad"]["heard_ms"] == (heard_ms if math.isnan(at) else None), (at, rows["bad"])
    after = rooms.metrics()
    assert snap.shared_memory_rejected >= counted + len(wrong)
    assert after["chorus_shared_memory_rejected_total"] == snap.shared_memory_rejected
    heard = after["chorus_heard_seconds_count"] - before["chorus_heard_seconds_count"]
    waited = after["chorus_heard_seconds_sum"] - before["chorus_heard_seconds_sum"]
    assert heard > 0 and 0.0 <= waited <= heard * 1.0, (heard, waited)  # the good frames', none above 1 s
    rooms.tick(2)  # times the room writes at now again: heard again
    assert rooms.snapshot()[1]["bad"]["heard_ms"] == heard_ms
