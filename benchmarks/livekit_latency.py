"""The latency Chorus adds between a caller and the engine, through a real LiveKit server, in echo mode.

This module is the command and its figures: one run with a fresh worker, the parts' percentiles and the
report. The callers, the measured session and the matching of a burst's times are benchmarks/latency/'s.

`python -m benchmarks.livekit_latency --callers 16 --seconds 20` starts the worker as a user does
(`python -m agent start`, tiny preset, CPU, one slot per caller) with CHORUS_ECHO=true (engine/tick/echo.py, a
measurement tool): the tick runs as always, but each live session's output frame is its own input frame of
that tick, resampled to 22.05 kHz, so every caller hears itself back through the whole path: WebRTC to the
server and on to the worker, livekit-agents' room input (80 ms frames at 16 kHz), the engine's inbox and tick,
the duplex adapter and its turn gate, the 160 ms playout buffer, the agent's track, back through the server
to the caller.

Each caller is a real participant (the `livekit` rtc SDK) publishing a 48 kHz tone of its own frequency with a
20 ms burst (a 1 kHz tone at 0.7 full scale) about every 0.5 s. A burst's onset is timed four times:
  - leaving the caller (the capture time of its 20 ms frame, plus what the SDK still queued, plus its place
    in the frame);
  - entering the engine: the engine logs every input frame with a sample above `engine.tick.echo.MARK`: when
    it was pushed into the session's inbox, when the tick that consumed it started, when the output frame was
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
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.call import room_label
from benchmarks.latency import hops
from benchmarks.latency.caller import RATE, TONE, Caller
from benchmarks.latency.session import session
from benchmarks.latency.timing import constants, match
from testkit.server import server_from_env
from testkit.stats import percentiles
from testkit.worker import Worker, seeded

START_S = 300.0  # a worker on a machine busy with other work can take minutes to register


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


def playout_wait_ms(log: str) -> float | None:
    """How long the model's chunks waited in the playout, from arrival to play, on average over the calls
    (the playout's `waited_s` and `model_chunks` in each "call ended" line of the worker's log)."""
    waited = chunks = 0.0
    for line in log.splitlines():
        w, n = re.search(r"waited_s ([0-9.]+)", line), re.search(r"model_chunks (\d+)", line)
        if "call ended" in line and w and n:
            waited, chunks = waited + float(w.group(1)), chunks + int(n.group(1))
    return round(waited / chunks * 1e3, 1) if chunks else None


def run(
    n: int, seconds: float, seed: int, tone: float, tmp: Path, dump: Path | None = None, fixed: bool = False
) -> dict:
    """One measurement with a fresh worker (`fixed`: the fixed-buffer baseline, CHORUS_FIXED_BUFFERS)."""
    server = server_from_env("livekit_latency", confined=True)
    k = constants()
    seeded(tmp)
    worker = Worker(server, tmp, slots=n, CHORUS_ECHO="true", CHORUS_FIXED_BUFFERS=str(fixed).lower())
    worker.env.pop("CHORUS_TEACHER_FORCING", None)  # echo replaces whatever the model says: nothing to script
    try:
        worker.start(timeout=START_S)
    except BaseException:
        worker.stop()
        raise
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
        log = worker.log.read_text(errors="replace")
        gated = log.count("echo mode:")
    engine["playout_wait_ms"] = playout_wait_ms(log)
    matched = [match(c, engine["frames"], k) for c in callers]
    times, rx = hops.room_times(log), engine["rx_jitter_by_label"]
    for c, (rows_c, _) in zip(callers, matched, strict=True):
        label = room_label(c.room)
        hops.split(rows_c, label, times.get(label), rx.get(label))
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
    fig = {p: percentiles([r[p] for r in rows]) for p in parts}
    model_ms = k["perception_lag_ms"] + k["codec_delay_ms"]
    fig["mouth_to_ear"] = percentiles([r["round_trip"] + model_ms for r in rows])
    rx_callers = [c.receive_stats() for c in callers]
    caller_nq = [x["delay_ms"] for x in rx_callers if x and "delay_ms" in x]
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
        "hops_ms": hops.hops(rows),  # every hop of the way, in and out (benchmarks/latency/hops.py)
        "caller_jitter_buffer_ms": round(float(np.median(caller_nq)), 1) if caller_nq else None,
        # what callers heard: gaps inside the agent's turns, and its late frames the playout absorbed
        "heard": {"gaps": engine["playout_gaps"], "late_absorbed": engine["late_absorbed"]},
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
        "sender_late_ms": percentiles(list(late)),
        # each caller's jitter buffer for the agent's audio over the window (NetEQ), part of after_engine
        "caller_jitter_buffer": rx_callers,
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
    rx_in = [x for x in eng.get("rx_jitter_ms", []) if x]
    if rx_in:
        print(
            f"      of which the worker's jitter buffer (NetEQ), mean lately: {np.median(rx_in):g} ms"
            + (f" (median of {len(rx_in)} rooms)" if len(rx_in) > 1 else "")
            + f", concealed {eng.get('rx_concealed_s', 0)} s"
        )
    print(line("    waiting in the inbox for the tick", "inbox_wait"))
    print(line("live step (tick start -> output frame handed out)", "live_step"))
    print(line("(b) output frame handed out -> arriving at the caller", "b"))
    print(line("    its place in the output frame", "framing_out"))
    print(line("    playout buffer, agent track, server, caller jitter buf", "after_engine"))
    if eng.get("playout_wait_ms") is not None:
        print(
            f"      of which the playout's wait, mean: {eng['playout_wait_ms']} ms (a turn's start delay at "
            f"the end: {', '.join(f'{x:g}' for x in eng.get('start_delay_ms', []))} ms)"
        )
    rx = [r for r in res.get("caller_jitter_buffer", []) if r]
    if rx:
        print(
            "      of which the caller's jitter buffer (WebRTC's NetEQ), mean over the window: "
            + ", ".join(f"{k} {np.median([r[k] for r in rx]):g}" for k in rx[0])
            + (f" (median of {len(rx)} callers)" if len(rx) > 1 else "")
        )
    print("\n".join(hops.report(res["hops_ms"], res.get("caller_jitter_buffer_ms"))))
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
        f"  heard: {eng['playout_gaps']} gaps in the agent's turns, {eng['late_absorbed']} late frames the "
        f"playout absorbed"
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
        "which it may shed when a session falls behind; above 0.028 it is speech, which the room never "
        "leaves out to align the frames with the ticks",
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
