"""One measured session of the echo-latency benchmark: the callers join one after another, wait for their
agents, send their tone until every session is live in the engine, then burst for the measured window while
the machine's load is read. Returns the callers with their records and the engine's figures; knows nothing of
how a burst is timed (timing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid

import numpy as np

from agent.call import room_label
from benchmarks.latency.caller import Caller
from testkit.machine import cpu_times, other_workers
from testkit.server import Server
from testkit.worker import Worker

JOIN_EVERY_S = 0.25  # one caller joins after another
HEARD = ("playout_gaps", "playout_gap_s", "late_absorbed")  # per session, what its caller heard
AGENT_WAIT_S = 90.0  # a caller whose agent is not heard by then is left out of the figures


async def session(
    server: Server, worker: Worker, n: int, seconds: float, seed: int, tone: float
) -> tuple[list[Caller], dict]:
    """`n` callers on `worker` for `seconds` of bursts: the callers that heard their agent, and the engine's
    figures over the window (its echo log in "frames")."""
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
        await asyncio.gather(*(c.read_receive() for c in callers))
        measure.set()
        await asyncio.sleep(seconds)
        measure.clear()
        for c in callers:
            c._next = -1
        await asyncio.sleep(1.5)  # the last bursts' echoes
        await asyncio.gather(*(c.read_receive() for c in callers))
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
        # what each caller heard (agent/audio_out/heard.py): the gaps beside the late frames absorbed
        "late_absorbed": sum(s.get("late_absorbed", 0) for s in ours),
        "heard": {s["label"]: {k: s.get(k, 0) for k in HEARD} for s in ours},
        "rx_jitter_by_label": {s["label"]: s.get("rx_jitter_ms", 0.0) for s in ours},
        "tick_shift_ms": snap.get("tick_shift_ms", 0.0),
        # each room's jitter buffer for its caller's audio (WebRTC's NetEQ in the worker), its last reading
        "rx_jitter_ms": [s.get("rx_jitter_ms", 0.0) for s in ours],
        "rx_concealed_s": round(sum(s.get("rx_concealed_s", 0.0) for s in ours), 3),
        # each room's playout at the end: a turn's start delay (the measured jitter and its margin)
        "start_delay_ms": [s.get("start_delay_ms", 0.0) for s in ours],
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
