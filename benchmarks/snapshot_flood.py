"""What a flood of `/snapshot` requests, or idle connections held from many addresses, cost the live calls and
the endpoint's own clients: the same simulation run quiet, flooded and held.

`python -m benchmarks.snapshot_flood [--rooms 4] [--seconds 60] [--clients 20] [--flood-seconds 20]
[--idle-addresses 100] [--idle-per-address 4]` runs `python -m agent simulate --rooms N --seconds S
--metrics-port 0` three times, as a user does (its own process, which sets its allocator itself). The first
run is left alone. In the second, once the talk has begun, `--clients` threads of this process each request
`/snapshot` in a tight loop (a new connection per request, no pause) for `--flood-seconds`, in the middle of
the talk. In the third, for the same window, `--idle-addresses` client addresses (127.0.0.10 and on: all of
127/8 is loopback) each hold `--idle-per-address` connections that never finish a request (half send nothing,
half the start of a request line), each opened again a second after the endpoint closes it, while a client of
its own address (127.0.0.3) asks for `/snapshot` and `/metrics` in turn four times a second and times each
answer (the bound is a second). Each run reports the simulation's own figures for its talk window (live step
p50/p99/max, missed deadlines, slipped ticks, skipped caller frames), what the engine counted during the
window (read from `/metrics` at its start and end, by a client of its own address, 127.0.0.2), the clients'
answers by status or the held connections and the timed answers, and the load average before and after (the
machine may be shared: a run whose load average moved a lot was disturbed).
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from agent.sim.report import TICK_FIGURES
from testkit.worker import http_exchange

ROOT = Path(__file__).resolve().parent.parent
PROBE_FROM = "127.0.0.2"  # the window's probe is a client of its own (loopback: all of 127/8 is this machine)
TIMED_FROM = "127.0.0.3"  # the timed client of the held run
ANSWER_S = 1.0  # what an answer to the endpoint's own clients may take
HOLD_REOPEN_S = 1.0  # a held connection the endpoint closed is opened again this much later
RUNS = ("quiet", "flood", "held")
_PROM = re.compile(r"^(chorus_\w+?)(?:\{le=\"([^\"]+)\"\})? ([0-9.e+-]+)$", re.M)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def get(port: int, path: str, timeout: float, source: str | None = None) -> tuple[int, bytes]:
    """One request on a new connection: (status, body); status 0 when the connection failed."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    try:
        data = http_exchange(port, request, timeout, source)
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


def hold(port: int, addresses: int, per: int, seconds: float) -> dict:
    """`addresses` client addresses (127.0.0.10 and on) each holding `per` connections that never finish a
    request, for `seconds`; each the endpoint closes is opened again HOLD_REOPEN_S later. Returns how many
    were opened, how many the endpoint closed, and how many were held at the end."""
    sel = selectors.DefaultSelector()
    due = [(0.0, f"127.0.0.{10 + a // per}", a % per) for a in range(addresses * per)]  # (when, source, k)
    opened = closed = failed = 0
    stop = time.monotonic() + seconds
    while (now := time.monotonic()) < stop:
        later = []
        for when, source, k in due:
            if when > now:
                later.append((when, source, k))
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.settimeout(1.0)
                s.bind((source, 0))
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET /snap" if k % 2 else b"")
                s.setblocking(False)
            except OSError:
                s.close()
                failed += 1
                later.append((now + HOLD_REOPEN_S, source, k))
                continue
            sel.register(s, selectors.EVENT_READ, (source, k))
            opened += 1
        due = later
        for key, _ in sel.select(timeout=0.05):
            sel.unregister(key.fileobj)
            key.fileobj.close()
            closed += 1
            due.append((time.monotonic() + HOLD_REOPEN_S, *key.data))
    held = len(sel.get_map())
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    sel.close()
    return {
        "addresses": addresses,
        "per_address": per,
        "opened": opened,
        "closed_by_endpoint": closed,
        "failed": failed,
        "held_at_end": held,
    }


def timed(port: int, seconds: float, every_s: float = 0.25) -> dict:
    """`/snapshot` and `/metrics` in turn from TIMED_FROM every `every_s` for `seconds`: how many were
    answered (200), how many within ANSWER_S, and the answers' p50 and max."""
    took: list[float] = []
    statuses: Counter = Counter()
    stop = time.monotonic() + seconds
    k = 0
    while time.monotonic() < stop:
        started = time.monotonic()
        status, _ = get(port, ("/snapshot", "/metrics")[k % 2], timeout=5, source=TIMED_FROM)
        statuses[status] += 1
        if status == 200:
            took.append(time.monotonic() - started)
        k += 1
        time.sleep(max(0.0, started + every_s - time.monotonic()))
    took.sort()
    return {
        "requests": k,
        "answered": statuses.get(200, 0),
        "within_1s": sum(t < ANSWER_S for t in took),
        "p50_ms": round(1000 * took[len(took) // 2], 1) if took else None,
        "max_ms": round(1000 * took[-1], 1) if took else None,
        "other": {str(s): n for s, n in statuses.items() if s != 200},
    }


def held(port: int, args: argparse.Namespace, seconds: float) -> dict:
    """The held run's window: the connections held and the timed client, side by side."""
    out: dict = {}
    holder = threading.Thread(
        target=lambda: out.update(held=hold(port, args.idle_addresses, args.idle_per_address, seconds)),
        daemon=True,
    )
    holder.start()
    time.sleep(min(1.0, seconds / 4))  # the held connections in place first
    out["timed"] = timed(port, seconds - min(1.0, seconds / 4))
    holder.join(timeout=seconds + 30)
    return out


def environment() -> dict[str, str]:
    """The user's environment without Chorus settings (the simulation's defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHORUS_", "DATABASE_URL"))}
    if shutil.which("nvidia-smi") is None:
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def run(args: argparse.Namespace, name: str) -> dict:
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
        if name == "flood":
            log(f"  {name}: {args.clients} clients on /snapshot for {flood_s:g} s")
            answers = flood(port[0], args.clients, flood_s)
        elif name == "held":
            log(
                f"  {name}: {args.idle_addresses} addresses x {args.idle_per_address} idle connections for "
                f"{flood_s:g} s, /snapshot and /metrics timed from {TIMED_FROM}"
            )
            answers = held(port[0], args, flood_s)
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
    keys = ("ended", "rooms_live", *TICK_FIGURES)
    result = {k: sim.get(k) for k in keys} | {"exit": proc.returncode, "flood_window": probe}
    result |= {"answers": answers, "load_average": [round(load_before[0], 2), round(load_after[0], 2)]}
    log(
        f"  {name}: live step p50 {result['live_ms_p50']} / p99 {result['live_ms_p99']} ms, missed deadlines "
        f"{result['missed_deadlines']}, slipped ticks {result['slipped_ticks']}, skipped frames "
        f"{result['skipped_frames']}"
        + (
            f"; /snapshot served {answers['served']}, refused {answers['refused']}"
            if "served" in answers
            else ""
        )
        + (
            f"; timed answers {answers['timed']['within_1s']}/{answers['timed']['requests']} within 1 s "
            f"(max {answers['timed']['max_ms']} ms)"
            if "timed" in answers
            else ""
        )
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
    p.add_argument(
        "--idle-addresses", type=int, default=100, help="addresses holding idle connections (default 100)"
    )
    p.add_argument("--idle-per-address", type=int, default=4, help="idle connections each holds (default 4)")
    p.add_argument("--only", choices=RUNS, help="run one of the three")
    p.add_argument("--out", default="out/snapshot_flood", help="the simulations' output folders")
    args = p.parse_args()
    results = {name: run(args, name) for name in RUNS if args.only in (None, name)}
    summary = {"rooms": args.rooms, "seconds": args.seconds, "clients": args.clients, **results}
    print(json.dumps(summary))
    return 0 if all(r["exit"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
