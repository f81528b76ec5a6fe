"""Phone calls at once on one worker, through the real LiveKit server's SIP machinery.

`python -m benchmarks.phone_calls --calls 16 --seconds 30` starts a worker as a user does (`python -m
agent start`, tiny preset, CPU, one slot per call, teacher forcing so the phone concierge greets and
answers), makes its phone line with `python -m agent sip setup` (a trunk and a dispatch rule on the server,
which needs Redis), then places every call as LiveKit's SIP bridge would: scripts/sip-bridge (the stand-in
for the bridge's control plane; no SIP or RTP on the wire) asks the server to authenticate the trunk and
evaluate the dispatch rule, and signs the caller's token. Each caller joins its own room with that token (a
participant of kind SIP), is answered (`sip.callStatus` active once the agent's track is subscribed, as
the bridge does), and talks through a phone line: 8 kHz, G.711 mu-law coded and decoded, back up to 48 kHz,
without RED.

Once every call is answered and live in the engine it measures `--seconds` of steady calls: CPU of the
worker's processes from /proc (the worker with its rooms, and the engine's process), the live step and the
engine's counters from its snapshot, and per call what the caller heard (seconds of the agent's speech, its
transcript, the longest wait between frames). Needs scripts/livekit.sh's server with Redis (start_livekit,
inside a namespace made by netns_up) and the stand-in (ensure_livekit). The last line is one JSON object. A
benchmark, not a test: it asserts nothing but that the calls were placed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from testkit.callers import RATE, caller_pcm
from testkit.machine import cmdline, cpu_seconds, tree
from testkit.server import agent_sip, server_from_env
from testkit.sip import PhoneCaller, find_bridge, inbound
from testkit.stats import percentiles
from testkit.worker import Worker, seeded, sessions_by_label

TRUNK_NUMBER = "+15550100"  # fictional (+1 555 01xx)
ANSWER_WAIT_S = 120.0  # for the agent's track in every call
JOIN_EVERY_S = 0.5  # between two calls' arrivals (--apart)


def caller_number(i: int) -> str:
    return f"+1202555{i:04d}"  # fictional: 555 numbers


def is_engine(pid: int) -> bool:
    return "engine.door.serve" in cmdline(pid)


async def run_calls(
    server, worker: Worker, calls: list[dict], seconds: float, apart: float = JOIN_EVERY_S
) -> dict:
    speech = caller_pcm("caller_booking.wav")
    everyone = [PhoneCaller(server, call) for call in calls]

    async def ring(c: PhoneCaller, i: int) -> None:
        await asyncio.sleep(apart * i)  # the calls come in one after another, as calls do
        await c.join()

    await asyncio.gather(*(ring(c, i) for i, c in enumerate(everyone)))
    try:
        waits = [asyncio.ensure_future(c.first_audio.wait()) for c in everyone]
        await asyncio.wait(waits, timeout=ANSWER_WAIT_S)
        for w in waits:
            w.cancel()
        callers = [c for c in everyone if c.first_audio.is_set()]
        missing = [c for c in everyone if not c.first_audio.is_set()]
        if missing:
            print(
                f"phone_calls: {len(missing)} of {len(everyone)} calls heard no agent within "
                f"{ANSWER_WAIT_S:.0f} s (agent joined: {sum(c.agent_joined.is_set() for c in missing)}); "
                "measuring the others",
                file=sys.stderr,
            )
        if not callers:
            raise SystemExit(f"phone_calls: no call was answered; the worker's log:\n{worker.tail(30)}")
        rooms = {c.room_name for c in callers}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every call live in the engine
            sessions = sessions_by_label(worker.snapshot())
            live = {r for r in rooms if sessions.get(r, {}).get("phase") == "live"}
            if rooms <= live:
                break
            await asyncio.sleep(0.25)
        else:
            raise SystemExit(
                f"phone_calls: not every call went live within 120 s ({len(live)} of {len(rooms)})"
            )
        talking = [asyncio.ensure_future(c.speak(speech, seconds=seconds + 5)) for c in callers]
        await asyncio.sleep(2.0)  # every caller talking
        pids = tree(worker.proc.pid)
        before, snap0, t0 = cpu_seconds(pids), worker.snapshot(), time.monotonic()
        heard0 = [c.heard.audible_s() for c in callers]
        turn_starts: dict[tuple[str, int], float] = {}  # (session, turn) -> its tick to its first sample out
        queued: list[
            float
        ] = []  # each call's playout queue (ms ahead of the caller's ear), every half second
        while time.monotonic() < t0 + seconds:
            await asyncio.sleep(0.5)
            for s in (await asyncio.to_thread(worker.snapshot))["sessions"]:
                if s.get("turn_start_ms") is not None:
                    turn_starts.setdefault((s["id"], s["turns"]), s["turn_start_ms"])
                queued.append(s.get("playout_ms", 0.0))
        after, snap1, t1 = cpu_seconds(pids), worker.snapshot(), time.monotonic()
        heard1 = [c.heard.audible_s() for c in callers]
        for t in talking:
            t.cancel()
        await asyncio.gather(*talking, return_exceptions=True)
    finally:
        await asyncio.gather(*(c.leave() for c in everyone))
    wall = t1 - t0
    used = {p: after[p] - before.get(p, after[p]) for p in after}
    engine = sum(v for p, v in used.items() if is_engine(p)) / wall
    worker_cores = sum(v for p, v in used.items() if not is_engine(p)) / wall
    return {
        "unanswered": len(everyone) - len(callers),
        "calls": [
            {
                "answered": c.answered_at is not None,
                "heard_speech_s": round(c.heard.audible_s(), 1),
                "speech_in_window_s": round(h1 - h0, 1),
                "transcripts": len(c.heard.transcripts),
                "longest_gap_ms": round(c.heard.longest_gap() * 1000),
            }
            for c, h0, h1 in zip(callers, heard0, heard1, strict=True)
        ],
        "window_s": round(wall, 1),
        "turn_start_ms": {"n": len(turn_starts), **percentiles(list(turn_starts.values()))},
        "playout_queued_ms": percentiles(queued),
        "worker_cores": round(worker_cores, 3),
        "engine_cores": round(engine, 3),
        "snapshot": {
            "live_ms_p50": snap1["live_ms_p50"],
            "live_ms_p99": snap1["live_ms_p99"],
            "missed_deadlines": snap1["missed_deadlines"] - snap0["missed_deadlines"],
            "ticks": snap1["ticks"] - snap0["ticks"],
            "underruns": snap1["underruns"] - snap0["underruns"],
            "dropped_frames": snap1["dropped_frames"] - snap0["dropped_frames"],
            "skipped_frames": snap1["skipped_frames"] - snap0["skipped_frames"],
            "sessions": len(snap1["sessions"]),
            "callers": sorted({s["caller"] for s in snap1["sessions"]}),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0, help="the steady window measured")
    ap.add_argument("--log", type=Path, default=None, help="keep the worker's log here")
    ap.add_argument(
        "--apart",
        type=float,
        default=JOIN_EVERY_S,
        help="seconds between two arrivals (0: all at once)",
    )
    args = ap.parse_args()
    server = server_from_env("phone_calls")
    if not os.environ.get("CHORUS_TEST_LIVEKIT_REDIS"):
        raise SystemExit("phone_calls: the LiveKit server runs without Redis, which its SIP API needs")
    bridge = find_bridge()
    if isinstance(bridge, str):
        raise SystemExit(f"phone_calls: {bridge}")
    with tempfile.TemporaryDirectory() as tmp:
        seeded(Path(tmp))
        worker = Worker(server, Path(tmp), slots=args.calls).launch()
        name = f"bench-{uuid.uuid4().hex[:6]}"
        try:
            setup = agent_sip(
                server, "setup", "--number", TRUNK_NUMBER, "--name", name, agent_name=worker.agent_name
            )
            if setup.returncode != 0:
                raise SystemExit(f"phone_calls: sip setup failed: {setup.stderr.strip()}")
            worker.start(timeout=180)
            calls = []
            for i in range(args.calls):
                out = inbound(server, bridge, "--from", caller_number(i), "--to", TRUNK_NUMBER)
                if out.returncode != 0:
                    raise SystemExit(f"phone_calls: call {i} was not placed: {out.stdout.strip()}")
                calls.append(json.loads(out.stdout))
            print(f"{len(calls)} calls placed through the server's dispatch rule; answering...", flush=True)
            t = time.monotonic()
            res = asyncio.run(run_calls(server, worker, calls, args.seconds, args.apart))
            res["setup_s"] = round(time.monotonic() - t, 1)
            if res["unanswered"]:
                log = worker.log.read_text(errors="replace").splitlines()
                said = [line for line in log if "WARNING" in line or "ERROR" in line or "call ended" in line]
                print(
                    "the worker's warnings, errors and ended calls:", *said[-40:], sep="\n", file=sys.stderr
                )
        finally:
            worker.stop()
            agent_sip(server, "teardown", "--name", name, agent_name=worker.agent_name)
            if args.log is not None:
                args.log.write_bytes(worker.log.read_bytes())
    calls = res["calls"]
    snap = res["snapshot"]
    heard = [c["speech_in_window_s"] for c in calls]
    print(
        f"{len(calls) + res['unanswered']} phone calls on one worker ({os.cpu_count()} cores, tiny preset), "
        f"{res['unanswered']} unanswered; of the others: "
        f"{sum(c['answered'] for c in calls)} answered, {sum(h > 0 for h in heard)} heard the agent in the "
        f"{res['window_s']} s window (speech per call min {min(heard)} s, median {np.median(heard):.1f} s), "
        f"{sum(c['transcripts'] > 0 for c in calls)} got a transcript"
    )
    ts = res["turn_start_ms"]
    print(
        f"  a turn's start, its tick to its first sample on the agent's track: p50 {ts['p50']} ms, p99 "
        f"{ts['p99']} ms, max {ts['max']} ms ({ts['n']} turns); the playout's queue p50 "
        f"{res['playout_queued_ms']['p50']} ms, max {res['playout_queued_ms']['max']} ms"
    )
    print(
        f"  worker {res['worker_cores']} cores (rooms), engine {res['engine_cores']} cores; "
        "live step p50 / p99 "
        f"{snap['live_ms_p50']} / {snap['live_ms_p99']} ms, missed deadlines {snap['missed_deadlines']} of "
        f"{snap['ticks']} ticks, underruns {snap['underruns']}, dropped {snap['dropped_frames']}, skipped "
        f"{snap['skipped_frames']}; per call {res['worker_cores'] / len(calls):.3f} cores"
    )
    print(json.dumps({"calls_placed": len(calls), "rate": RATE, **res}))


if __name__ == "__main__":
    main()
