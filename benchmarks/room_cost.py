"""What a room costs a Chorus worker, through a real LiveKit server, with LiveKit's agent load tester as the
callers.

`python -m benchmarks.room_cost --rooms 1 4 8 16 --seconds 20` starts, for each N, a worker as a user does
(`python -m agent start`, tiny preset, N slots, teacher forcing so the agents speak; `--processes`: each room
in a process of its own), measures it idle for `--seconds` (the live step with no room), then serving N
sessions with no room behind them (testkit/headless.py: the engine's own socket and shared memory,
fed and teacher-forced as the rooms are; what the rooms add to the step is measured against this), the same
beside a process that does nothing but spin one core (what merely sharing the machine does to the step), then
runs the load tester with N rooms and measures a steady window of `--seconds` once every room is in its call.
CPU comes from /proc: per process of the worker's tree (the worker, its forkserver, each room's process) and
per thread, split into Python threads (those that carry the process's own name: CPython does not name its
threads for the OS) and native ones (the rtc SDK's tokio, audio and network threads, which name themselves).
The engine's process (`engine.door.serve`) is counted apart; its busiest Python thread is the tick. A room's
cost is what the tree spends with N rooms beyond what it spends idle, over N; its Python share the same for
the Python threads outside the engine's process. The live step's p50 and p99 over each window come from the
engine's Prometheus histogram (`chorus_live_step_seconds`, interpolated within its buckets) and its mean from
the histogram's sum.

Per N it prints the worker tree's cores, each room's cores in total and in Python, the live step idle, with N
sessions and no rooms (alone, and beside the spinning process), and with the rooms, memory per room process,
and the rooms per core this implies. Needs scripts/livekit.sh's server and load tester (as
benchmarks/livekit_load.py). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from testkit.headless import HeadlessSessions, engine_address
from testkit.machine import TICKS_PER_S, cmdline, thread_stats, tree
from testkit.server import load_tester, server_from_env
from testkit.worker import Worker, seeded

PROG = "room_cost"


def threads(pid: int) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process name, thread name, CPU seconds so far) for every thread of the tree."""
    found, pnames = {}, {}
    for p, t, name, fields in thread_stats(pid):
        if p not in pnames:
            try:
                pnames[p] = Path(f"/proc/{p}/comm").read_text().strip()
            except OSError:
                continue
        found[(p, t)] = (pnames[p], name, (int(fields[11]) + int(fields[12])) / TICKS_PER_S)
    return found


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def histogram(metrics_url: str) -> tuple[dict[float, float], float, float]:
    """The live step's cumulative bucket counts by upper bound (ms), its sum (s) and count."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    buckets, total, count = {}, 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("chorus_live_step_seconds_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets[float("inf") if le == "+Inf" else float(le) * 1000] = float(line.split()[-1])
        elif line.startswith("chorus_live_step_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("chorus_live_step_seconds_count"):
            count = float(line.split()[-1])
    return buckets, total, count


def window_live(a, b) -> dict:
    """p50, p99 (interpolated in the buckets) and mean of the live steps between two histogram readings."""
    bounds = sorted(b[0])
    counts = [b[0][k] - a[0].get(k, 0.0) for k in bounds]
    n = b[2] - a[2]
    if n <= 0:
        return {"ticks": 0, "p50": None, "p99": None, "mean": None}

    def pct(q: float) -> float:
        want, lo = q * n, 0.0
        for i, bound in enumerate(bounds):
            if counts[i] >= want:
                below = counts[i - 1] if i else 0.0
                hi = bound if bound != float("inf") else lo * 2
                return lo + (hi - lo) * (want - below) / max(counts[i] - below, 1e-9)
            lo = bound
        return lo

    return {
        "ticks": int(n),
        "p50": round(pct(0.5), 1),
        "p99": round(pct(0.99), 1),
        "mean": round(1000 * (b[1] - a[1]) / n, 1),
    }


def measure(worker: Worker, seconds: float) -> tuple[dict, dict]:
    """CPU per thread over `seconds`, and the live step over the same window."""
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    h0, t0, w0 = histogram(url), threads(worker.proc.pid), time.monotonic()
    time.sleep(seconds)
    h1, t1, w1 = histogram(url), threads(worker.proc.pid), time.monotonic()
    wall = w1 - w0
    cpu = {
        key: (pname, tname, (t1[key][2] - t0.get(key, (0, 0, t1[key][2]))[2]) / wall)
        for key, (pname, tname, _) in t1.items()
    }
    return cpu, window_live(h0, h1)


def split(cpu: dict, engine_pid: int | None) -> dict:
    """Cores by where they run: the engine's process (its tick thread, the rest), and everything else of the
    worker's tree, where the rooms run (Python threads, native threads)."""
    engine = {k: v for k, v in cpu.items() if k[0] == engine_pid}
    engine_python = [v[2] for v in engine.values() if v[1] == v[0]]
    rooms = {k: v for k, v in cpu.items() if k[0] != engine_pid}
    return {
        "worker_tree": round(sum(v[2] for v in cpu.values()), 3),
        "engine_process": round(sum(v[2] for v in engine.values()), 3),
        "tick_thread": round(max(engine_python, default=0.0), 3),
        "rooms_python": round(sum(v[2] for v in rooms.values() if v[1] == v[0]), 3),
        "rooms_native": round(sum(v[2] for v in rooms.values() if v[1] != v[0]), 3),
        "top_native": sorted(
            ((v[1], round(v[2], 3)) for v in rooms.values() if v[1] != v[0]), key=lambda x: -x[1]
        )[:8],
    }


def available(worker: Worker) -> bool:
    """No session on the engine, and the worker's last word to LiveKit on its capacity was that it has room
    (a worker the headless sessions filled said it was full, and a room dispatched before it says otherwise
    waits for another worker)."""
    log = worker.log.read_text(errors="replace")
    full, free = log.rfind("marking as unavailable"), log.rfind("marking as available")
    return not worker.snapshot()["sessions"] and full < free


def run(rooms: int, seconds: float, tmp: Path, env: dict[str, str]) -> dict:
    server = server_from_env(PROG)
    seeded(tmp)
    with Worker(server, tmp, slots=rooms, **env) as worker:
        time.sleep(3.0)  # the rooms' processes warm
        idle_cpu, idle_live = measure(worker, seconds)
        engine_pid = next((p for p in tree(worker.proc.pid)[1:] if "engine.door.serve" in cmdline(p)), None)
        if engine_pid is None:
            raise SystemExit(f"{PROG}: the worker runs no engine process")
        # the same engine serving as many sessions with no room behind them: what the rooms add to its step
        with HeadlessSessions(engine_address(engine_pid), rooms):
            time.sleep(min(10.0, seconds / 2))  # past the prompts' prefill and the greetings' start
            alone_cpu, alone_live = measure(worker, seconds)
            # ... and beside a process that only spins one core: what sharing the machine alone does to the
            # step (no room, no lock, no memory traffic to speak of)
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            try:
                _, spun_live = measure(worker, seconds)
            finally:
                spinner.kill()
                spinner.wait()
        deadline = time.monotonic() + 30
        while not available(worker) and time.monotonic() < deadline:  # their slots free, and LiveKit told
            time.sleep(0.2)
        cmd = [
            load_tester(PROG),
            *("--rooms", str(rooms), "--agent-name", worker.agent_name, "--echo-speech-delay", "2s"),
            *("--duration", f"{seconds * 2 + 30 + rooms * 2}s"),
            *("--url", server.url, "--api-key", server.key, "--api-secret", server.secret),
        ]
        tester = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60 + 5 * rooms
            while time.monotonic() < deadline:  # every room in its call
                if len(worker.snapshot()["sessions"]) >= rooms:
                    break
                time.sleep(0.5)
            joined = len(worker.snapshot()["sessions"])
            if joined < rooms:  # what the worker said, before its log goes with the temporary folder
                tail = worker.log.read_text(errors="replace").splitlines()[-40:]
                print(f"{rooms - joined} of {rooms} rooms not joined; the worker's log:", file=sys.stderr)
                print("\n".join(tail), file=sys.stderr)
            time.sleep(min(10.0, seconds / 2))  # past the prompts' prefill and the greetings' start
            busy_cpu, busy_live = measure(worker, seconds)
            snap = worker.snapshot()
            main_pid = worker.proc.pid
            kids = tree(main_pid)[1:]
            servers = [p for p in kids if "forkserver" in cmdline(p)]
            # the rooms' processes are the forkserver's children (their command line is the forkserver's)
            room_pids = [p for f in servers[:1] for p in tree(f)[1:]]
            memory = sorted(rss_mb(p) for p in room_pids)
            worker_rss = rss_mb(main_pid)
            # how each process's caller audio went: straight into the engine's ring
            # (agent/audio_in/audio_pump.py), or through Python (no compiler, CHORUS_NATIVE_AUDIO=false: no
            # line)
            log = worker.log.read_text(errors="replace")
            caller_audio = {
                "native_processes": log.count("caller audio goes from the rtc runtime straight"),
                "python_processes": log.count("caller audio goes through Python"),
            }
        finally:
            tester.kill()
            tester.wait(10)
    idle, busy = split(idle_cpu, engine_pid), split(busy_cpu, engine_pid)
    alone = split(alone_cpu, engine_pid)
    per_room = (busy["worker_tree"] - idle["worker_tree"]) / max(joined, 1)
    per_room_python = (busy["rooms_python"] - idle["rooms_python"]) / max(joined, 1)
    return {
        "rooms": rooms,
        "joined": joined,
        "seconds": seconds,
        "idle": idle,
        "busy": busy,
        "sessions_no_rooms": {"engine_process": alone["engine_process"], "tick_thread": alone["tick_thread"]},
        "live_idle_ms": idle_live,
        "live_sessions_ms": alone_live,
        "live_sessions_spinning_ms": spun_live,
        "live_rooms_ms": busy_live,
        # the live step with the rooms over the same engine serving as many sessions with no room (p50, p99)
        "rooms_over_sessions": [
            round(busy_live[q] / alone_live[q], 3) if busy_live[q] and alone_live[q] else None
            for q in ("p50", "p99")
        ],
        # the same engine with N sessions, no rooms, beside a process spinning one core, over it alone
        "spinning_over_sessions": [
            round(spun_live[q] / alone_live[q], 3) if spun_live[q] and alone_live[q] else None
            for q in ("p50", "p99")
        ],
        "per_room_cores": round(per_room, 4),
        "per_room_python_cores": round(per_room_python, 4),
        "rooms_per_core": round(1 / per_room, 1) if per_room > 0 else None,
        "worker_process_rss_mb": round(worker_rss, 1),
        "room_process_rss_mb": {
            "n": len(memory),
            "median": round(memory[len(memory) // 2], 1) if memory else None,
            "max": round(memory[-1], 1) if memory else None,
        },
        "missed_deadlines": snap["missed_deadlines"],
        "caller_audio": caller_audio,
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.room_cost", description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=20.0, help="each measured window")
    p.add_argument(
        "--processes",
        action="store_true",
        help="each room in a process of its own (CHORUS_ROOM_PROCESSES=true)",
    )
    args = p.parse_args()
    env = {"CHORUS_ROOM_PROCESSES": "true"} if args.processes else {}
    results = []
    for n in args.rooms:
        with tempfile.TemporaryDirectory(prefix="chorus-room-cost-") as tmp:
            r = run(n, args.seconds, Path(tmp), env)
        results.append(r)
        b, li, ls, lr = r["busy"], r["live_idle_ms"], r["live_sessions_ms"], r["live_rooms_ms"]
        print(
            f"{n:3d} rooms ({r['joined']} joined): worker tree {b['worker_tree']:.2f} cores (engine's tick "
            f"{b['tick_thread']:.2f}, rooms' Python {b['rooms_python']:.2f}, "
            f"rooms' native {b['rooms_native']:.2f}); "
            f"per room {r['per_room_cores']:.3f} cores, {r['per_room_python_cores']:.3f} in Python; "
            f"live step p50/p99 {li['p50']}/{li['p99']} ms idle, "
            f"{ls['p50']}/{ls['p99']} ms with {n} sessions and no rooms "
            f"({r['live_sessions_spinning_ms']['p50']}/{r['live_sessions_spinning_ms']['p99']} ms beside a "
            "process spinning a core), "
            f"{lr['p50']}/{lr['p99']} ms with the rooms; "
            f"room process RSS {r['room_process_rss_mb']['median']} MB; missed {r['missed_deadlines']}; "
            f"caller audio native in {r['caller_audio']['native_processes']} process(es), through Python in "
            f"{r['caller_audio']['python_processes']}",
            flush=True,
        )
    print(json.dumps({"rooms_in": "processes" if args.processes else "threads", "runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
