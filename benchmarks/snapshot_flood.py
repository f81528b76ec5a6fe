"""What a flood of `/snapshot` requests costs the live calls: the same simulation run quiet and flooded.

`python -m benchmarks.snapshot_flood [--rooms 4] [--seconds 60] [--clients 20] [--flood-seconds 20]` runs
`python -m agent simulate --rooms N --seconds S --metrics-port 0` twice, as a user does (its own process,
which sets its allocator itself). The first run is left alone. In the second, once the talk has begun,
`--clients` threads of this process each request `/snapshot` in a tight loop (a new connection per request, no
pause) for `--flood-seconds`, in the middle of the talk. Each run reports the simulation's own figures for its
talk window (live step p50/p99/max, missed deadlines, slipped ticks, skipped caller frames), what the engine
counted during the flood's window (read from `/metrics` at its start and end, by a client of its own address,
127.0.0.2), the clients' answers by status, and the load average before and after (the machine may be shared:
a run whose load average moved a lot was disturbed).
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_FROM = "127.0.0.2"  # the window's probe is a client of its own (loopback: all of 127/8 is this machine)
_PROM = re.compile(r"^(chorus_\w+?)(?:\{le=\"([^\"]+)\"\})? ([0-9.e+-]+)$", re.M)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def get(port: int, path: str, timeout: float, source: str | None = None) -> tuple[int, bytes]:
    """One request on a new connection: (status, body); status 0 when the connection failed."""
    try:
        with socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None
        ) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return 0, b""
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), body


def prometheus(port: int) -> dict[str, float]:
    """The engine's tick counters and live-step histogram buckets from `/metrics` (empty if not answered)."""
    status, body = get(port, "/metrics", timeout=30, source=PROBE_FROM)
    if status != 200:
        return {}
    out = {}
    for name, le, value in _PROM.findall(body.decode()):
        out[f"{name}:{le}" if le else name] = float(value)
    return out


def window(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """What the engine counted between two reads of `/metrics`; the live step's p99 as the histogram bucket
    it falls in (an upper bound; None above the last bucket, 1 s)."""
    if not before or not after:
        return {"read": False}

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    ticks = d("chorus_live_step_seconds_count")
    buckets = sorted(
        (float(k.split(":")[1]), d(k))
        for k in after
        if k.startswith("chorus_live_step_seconds_bucket:") and k.split(":")[1] != "+Inf"
    )
    p99 = next((le * 1000 for le, n in buckets if ticks and n >= 0.99 * ticks), None)  # None: above 1 s
    return {
        "read": True,
        "seconds": round(seconds, 1),
        "ticks": int(ticks),
        "ticks_due": int(seconds / 0.08),
        "missed_deadlines": int(d("chorus_missed_deadlines_total")),
        "slipped_ticks": int(d("chorus_slipped_ticks_total")),
        "live_ms_p99_at_most": p99,
    }


def flood(port: int, clients: int, seconds: float) -> dict:
    """`clients` threads requesting `/snapshot` as fast as they can for `seconds`: answers by status."""
    stop = time.monotonic() + seconds
    counts: list[Counter] = [Counter() for _ in range(clients)]

    def one(i: int) -> None:
        while time.monotonic() < stop:
            status, _ = get(port, "/snapshot", timeout=5)
            counts[i][status] += 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
    total = sum(counts, Counter())
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": sum(total.values()),
        "served": total.get(200, 0),
        "refused": total.get(429, 0),
        "failed": total.get(0, 0),  # no answer: refused connection, reset, or 5 s without a reply
        "other": {str(k): v for k, v in total.items() if k not in (0, 200, 429)},
    }


def environment() -> dict[str, str]:
    """The user's environment without Chorus settings (the simulation's defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHORUS_", "DATABASE_URL"))}
    if shutil.which("nvidia-smi") is None:
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def run(args: argparse.Namespace, flooded: bool) -> dict:
    name = "flood" if flooded else "quiet"
    out = Path(args.out) / name
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "simulate",
        "--rooms",
        str(args.rooms),
        "--seconds",
        str(args.seconds),
        "--metrics-port",
        "0",
        "--out",
        str(out),
    ]
    load_before = os.getloadavg()
    log(f"{name}: {' '.join(cmd[1:])} (load average {load_before[0]:.2f})")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: list[str] = []
    port: list[int] = []
    talk = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if m := re.match(r"engine snapshot at http://[\d.]+:(\d+)/snapshot", line):
                port.append(int(m.group(1)))
            if line.startswith("[talk"):
                talk.set()
                log(f"  {name}: {line}")
        talk.set()  # the simulation ended (early, if the talk never began)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    talk.wait()
    t_talk = time.monotonic() - 1.0  # the first progress line comes a second into the talk
    flood_s = min(args.flood_seconds, args.seconds / 3)
    start = max(0.0, (args.seconds - flood_s) / 2)
    answers: dict = {}
    probe: dict = {"read": False}
    if port and proc.poll() is None:
        time.sleep(max(0.0, t_talk + start - time.monotonic()))
        before, t0 = prometheus(port[0]), time.monotonic()
        if flooded:
            log(f"  {name}: {args.clients} clients on /snapshot for {flood_s:g} s")
            answers = flood(port[0], args.clients, flood_s)
        else:
            time.sleep(flood_s)
        probe = window(before, prometheus(port[0]), time.monotonic() - t0)
    proc.wait()
    reader.join(timeout=10)
    try:
        sim = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(
            f"snapshot_flood: the {name} simulation did not finish:\n" + "\n".join(lines[-20:])
        ) from None
    load_after = os.getloadavg()
    keys = (
        "ended",
        "rooms_live",
        "ticks",
        "live_ms_p50",
        "live_ms_p99",
        "live_ms_max",
        "missed_deadlines",
        "overruns",
        "slipped_ticks",
        "skipped_frames",
        "dropped_frames",
        "underruns",
    )
    result = {k: sim.get(k) for k in keys} | {"exit": proc.returncode, "flood_window": probe}
    result |= {"answers": answers, "load_average": [round(load_before[0], 2), round(load_after[0], 2)]}
    log(
        f"  {name}: live step p50 {result['live_ms_p50']} / p99 {result['live_ms_p99']} ms, missed deadlines "
        f"{result['missed_deadlines']}, slipped ticks {result['slipped_ticks']}, skipped frames "
        f"{result['skipped_frames']}"
        + (f"; /snapshot served {answers['served']}, refused {answers['refused']}" if answers else "")
        + f"; load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.snapshot_flood", description=__doc__.splitlines()[0]
    )
    p.add_argument("--rooms", type=int, default=4, help="virtual rooms (default 4)")
    p.add_argument("--seconds", type=float, default=60.0, help="each simulation's talk (default 60)")
    p.add_argument("--clients", type=int, default=20, help="flooding clients (default 20)")
    p.add_argument(
        "--flood-seconds",
        type=float,
        default=20.0,
        help="how long they flood (default 20; at most a third of --seconds)",
    )
    p.add_argument("--only", choices=("quiet", "flood"), help="run one of the two")
    p.add_argument("--out", default="out/snapshot_flood", help="the simulations' output folders")
    args = p.parse_args()
    results = {}
    for flooded in (False, True):
        if args.only in (None, "flood" if flooded else "quiet"):
            results["flood" if flooded else "quiet"] = run(args, flooded)
    summary = {"rooms": args.rooms, "seconds": args.seconds, "clients": args.clients, **results}
    print(json.dumps(summary))
    return 0 if all(r["exit"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
