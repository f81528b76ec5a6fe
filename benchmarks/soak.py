"""A hotel's afternoon through the real stack: mixed calls for `--minutes` on two workers under a LiveKit
server with Redis, with a fleet fault every `--fault-every-s`, and at the end the database checked against
the calls.

`python -m benchmarks.soak --minutes 60 --seed 1` starts two workers as a user does (`python -m agent start`,
one agent name, tiny preset, CPU, teacher forcing so the agents speak and make their scripted tool calls;
forced tokens, not the dummy model's choice) and acts as their supervisor: a worker that exits is started
again. Calls arrive as a Poisson process whose rate keeps `--live` calls on (6 to 8 by default: an arrival
waits while 8 are on, and below 6 the next one comes at once), each lasting `--call-s` (1 to 3 minutes by
default) and hanging up wherever that falls, mid-turn included:
  - a quarter are phone calls: the bridge stand-in (scripts/sip-bridge) asks the server's dispatch rule for
    the call's room, and the caller talks through a G.711 line (testkit/sip.py);
  - a quarter make a scripted booking (`book_room` forced on the function channel), of which some cancel a
    booking an earlier call made (`change_or_cancel_reservation`) and some ask for a room sold out
    beforehand (the family suites on one stay, booked by residents before the run);
  - the rest are web callers; 5% of the web callers lose their network for 5-15 s (their process stopped,
    testkit/lone_caller.py) and come back as LiveKit's clients do.
Every `--fault-every-s` one fault of [fleet] is played on the worker serving most calls, in turn: the
worker SIGKILLed, its engine's process SIGKILLed (the worker starts it again), the worker drained (SIGTERM)
and replaced by a new one at once, as a rolling restart does.

It samples every SAMPLE_S: each worker's /snapshot (its sessions, missed deadlines, each live session's
frame-to-answer time and playout queue), the resident memory, open descriptors and threads of every process
(workers, engines, the workers' other children, the server, Redis, and this generator with its callers),
and the database's rows. Per window (`--window-s`): calls answered, refused and resumed, each ended call's
longest silence the agent's script did not ask for, the agent's frame-to-ear time p50 / p99, missed
deadlines, slots in use against calls live, memory, descriptors, threads and rows. At the end, once every
call has hung up: each booking made exactly once, no room held without its booking, every cancellation
applied, no conversation left of the ended calls, no slot in use. A progress line every 30 s; the last line
is one JSON object; a JSON record and a PNG of the figures over time are written to `--out`. Exit status 1
when a check fails.

A run that hangs fails instead: once no call has progressed for `--stall-s` (60 s; calls started, answered
and ended, frames the callers heard, testkit/watchdog.py), every thread's stack is written to stderr and to
`stacks.txt` in `--out`, the workers are killed (their logs kept), the last line is a JSON object saying so,
and the exit status is 3.

`--plant slot-leak` starts the workers with a defect planted (a hang-up no longer frees the call's slot), to
show the checks catch one. Needs the server of scripts/livekit.sh with its Redis (start_livekit, inside a
namespace made by netns_up) and the bridge stand-in (ensure_livekit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from testkit.fleet import drain, kill_engine, kill_worker
from testkit.server import ROOT, agent_sip, server_from_env
from testkit.sip import find_bridge
from testkit.soak_calls import CallRunner, plan_calls, sell_out
from testkit.soak_plot import plot
from testkit.soak_report import check, totals, windows
from testkit.soak_sampler import Recorder
from testkit.watchdog import STALL_S, Watchdog
from testkit.worker import Worker, seeded, sessions_by_label

TRUNK_NUMBER = "+15550100"  # fictional (+1 555 01xx)
SAMPLE_S = 5.0
PROGRESS_S = 30.0
SETTLE_S = 60.0  # after the last call: for the slots and the conversations to be let go
FAULTS = ("worker SIGKILL", "engine SIGKILL", "drain")
PLANTS = {"slot-leak": ROOT / "testkit" / "plants" / "slot_leak"}


class Fleet:
    """Two workers of one agent name, kept running: one that exits is started again (this is their
    supervisor); a drained one is replaced at once and left to finish."""

    def __init__(self, server, store_dir: Path, name: str, slots: int, env: dict[str, str]) -> None:
        self.server, self.store_dir, self.name, self.slots, self.env = server, store_dir, name, slots, env
        self.seats: list[Worker] = []
        self.retiring: list[Worker] = []  # drained, still handing over
        self.every: list[Worker] = []  # every worker started, for their logs
        self.started = 0
        self.events: list[tuple[float, str]] = []

    def _new(self) -> Worker:
        self.started += 1
        self.every.append(Worker(self.server, self.store_dir, slots=self.slots, name=self.name, **self.env))
        return self.every[-1]

    def start(self) -> None:
        self.seats = [self._new().launch() for _ in range(2)]
        for w in self.seats:
            w.start(timeout=180)

    def all(self) -> list[Worker]:
        return [*self.seats, *self.retiring]

    def supervise(self) -> None:
        """Start again a seat's worker that exited (killed); let go of drained ones that finished."""
        for i, w in enumerate(self.seats):
            if w.proc.poll() is not None:
                w.stop()
                self.events.append((time.monotonic(), f"worker exited ({w.proc.returncode}), started again"))
                self.seats[i] = self._new().launch()  # registers by itself; the calls go on meanwhile
        for w in list(self.retiring):
            if w.proc.poll() is not None:
                w.stop()
                self.retiring.remove(w)

    def busiest(self) -> Worker:
        def held(w: Worker) -> int:
            try:
                return len(w.snapshot()["sessions"])
            except (OSError, ValueError, KeyError):
                return -1

        return max(self.seats, key=held)

    def fault(self, kind: str) -> tuple[Worker, set[str], float]:
        """Play `kind` on the busiest worker; (it, the room labels it held, when it was played: the
        snapshots that choose it come first, and on a loaded machine they take a while)."""
        w = self.busiest()
        try:
            held = set(sessions_by_label(w.snapshot()))
        except (OSError, ValueError, KeyError):
            held = set()
        if kind == "worker SIGKILL":
            kill_worker(w)
        elif kind == "engine SIGKILL":
            kill_engine(w)
        else:
            drain(w)
            self.retiring.append(w)
            at = time.monotonic()
            self.seats[self.seats.index(w)] = self._new().launch()  # its replacement, registered meanwhile
            return w, held, at
        return w, held, time.monotonic()

    def stop(self) -> None:
        for w in self.all():
            w.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long calls arrive (default 60)")
    ap.add_argument("--seed", type=int, default=1, help="the calls' and faults' seed (default 1)")
    ap.add_argument("--live", default="6,8", help="calls on at once, FEWEST,MOST (default 6,8)")
    ap.add_argument("--call-s", default="60,180", help="a call's length, MIN,MAX seconds (default 60,180)")
    ap.add_argument("--fault-every-s", type=float, default=600.0, help="seconds between faults (default 600)")
    ap.add_argument("--window-s", type=float, default=300.0, help="the figures' window (default 300)")
    ap.add_argument(
        "--warmup-s", type=float, default=600.0, help="memory's warm-up per process (default 600)"
    )
    ap.add_argument("--slots", type=int, default=10, help="slots per worker (default 10)")
    ap.add_argument("--out", type=Path, default=Path("out/soak"), help="where the JSON and PNG go")
    ap.add_argument("--plant", choices=sorted(PLANTS), help="start the workers with a defect planted")
    ap.add_argument(
        "--stall-s", type=float, default=STALL_S, help="fail once no call progressed this long (default 60)"
    )
    args = ap.parse_args(argv)
    try:
        low, high = (float(x) for x in args.call_s.split(","))
        fewest, most = (int(x) for x in args.live.split(","))
    except ValueError:
        ap.error("--call-s is MIN,MAX seconds and --live FEWEST,MOST calls")
    if not 10 <= low <= high or not 1 <= fewest <= most or args.minutes <= 0 or args.stall_s <= 0:
        ap.error(
            "--call-s needs 10 <= MIN <= MAX, --live 1 <= FEWEST <= MOST, --minutes and --stall-s above 0"
        )
    args.call_s, args.live = (low, high), (fewest, most)
    server = server_from_env(ap.prog, confined=True)
    if not server.redis:
        raise SystemExit(f"{ap.prog}: the server runs without Redis (set CHORUS_TEST_LIVEKIT_REDIS)")
    bridge = find_bridge()
    if isinstance(bridge, str):
        raise SystemExit(f"{ap.prog}: {bridge}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the workers are stopped on the way out
    rng = random.Random(args.seed)
    plans = plan_calls(rng, args.minutes * 60, (fewest + most) / 2, (low, high))
    env = {"CHORUS_DRAIN_TIMEOUT_S": "60"}
    if args.plant:
        env["PYTHONPATH"] = os.pathsep.join([str(PLANTS[args.plant]), str(ROOT)])
    name = f"chorus-soak-{uuid.uuid4().hex[:6]}"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chorus-soak-") as tmp:
        store_dir = Path(tmp)
        seeded(store_dir)
        taken = sell_out(store_dir)
        fleet = Fleet(server, store_dir, name, args.slots, env)
        setup = agent_sip(server, "setup", "--number", TRUNK_NUMBER, "--name", name, agent_name=name)
        if setup.returncode != 0:
            raise SystemExit(f"{ap.prog}: sip setup failed: {setup.stderr.strip()}")
        try:
            print(
                f"soak: {len(plans)} calls over {args.minutes:g} min on two workers "
                f"({args.slots} slots each), "
                f"a fault every {args.fault_every_s:g} s{'; planted: ' + args.plant if args.plant else ''}",
                file=sys.stderr,
                flush=True,
            )
            fleet.start()
            rec = Recorder(store_dir, Path(tmp))
            runner = CallRunner(server, bridge, name, TRUNK_NUMBER, taken, rng, Path(tmp))
            with Watchdog(
                lambda: _progress(runner, rec),
                args.stall_s,
                what="no call",
                on_stall=lambda report: _stalled(report, args, fleet, server, name),
            ):
                asyncio.run(soak(args, plans, fleet, runner, rec))
        finally:
            fleet.stop()
            agent_sip(server, "teardown", "--name", name, agent_name=name)
            for i, w in enumerate(fleet.every):
                if w.log.exists():
                    (args.out / f"worker-{i + 1}.log").write_bytes(w.log.read_bytes())
        report = {
            "seed": args.seed,
            "minutes": args.minutes,
            "live": list(args.live),
            "call_s": [low, high],
            "plant": args.plant,
            "workers_started": fleet.started,
            **totals(rec, runner.records),
            "faults": rec.faults,
            "windows": windows(rec, runner.records, args.window_s),
            "checks": check(rec, runner.records, store_dir, args.warmup_s),
        }
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    (args.out / "samples.json").write_text(json.dumps(rec.samples))  # every sample, for a second look
    plot(report, rec, runner.records, args.out / "soak.png")
    for k, c in report["checks"].items():
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {k}: {c['detail']}", file=sys.stderr)
    print(
        json.dumps({k: v for k, v in report.items() if k != "windows"} | {"windows": len(report["windows"])})
    )
    return 0 if report["ok"] else 1


async def soak(args, plans, fleet: Fleet, runner: CallRunner, rec: Recorder) -> None:
    t0 = time.monotonic()
    rec.t0 = runner.t0 = t0
    end = t0 + args.minutes * 60
    tasks: list[asyncio.Task] = []
    faults = [t0 + args.fault_every_s * (k + 1) for k in range(int(args.minutes * 60 // args.fault_every_s))]
    next_sample = next_progress = next_ramp = t0
    pending = list(plans)
    fewest, most = args.live
    shortest = args.call_s[0]
    while True:
        now = time.monotonic()
        live = sum(r.left_at is None for r in runner.records)  # (a call's record is made as it starts)
        # a Poisson arrival is answered while fewer than the most calls are on, waits while as many are; below
        # the fewest, the next call comes at once (one a second)
        while pending and (
            (now >= t0 + pending[0].start_s and live < most) or (live < fewest and now >= next_ramp)
        ):
            plan = pending.pop(0)
            if end - now < shortest:  # too late for a whole call: none starts any more
                pending.clear()
                break
            plan.start_s, plan.length_s = now - t0, min(plan.length_s, end - now)
            if plan.drop_at_s is not None:
                plan.drop_at_s = min(plan.drop_at_s, 0.6 * plan.length_s)
            tasks.append(asyncio.ensure_future(runner.run(plan)))
            live += 1
            next_ramp = now + 1.0
        if faults and now >= faults[0]:
            faults.pop(0)
            kind = FAULTS[len(rec.faults) % len(FAULTS)]
            w, held, at = await asyncio.to_thread(fleet.fault, kind)
            rec.faults.append({"at_s": round(at - t0, 1), "kind": kind, "rooms": len(held)})
            runner.hit(held, at, kind)
            print(
                f"soak {_clock(at - t0)}: fault: {kind}, {len(held)} calls on it"
                f" ({time.strftime('%H:%M:%S', time.gmtime())} UTC)",
                file=sys.stderr,
                flush=True,
            )
        if now >= next_sample:
            next_sample += SAMPLE_S
            await asyncio.to_thread(fleet.supervise)
            await asyncio.to_thread(rec.sample, fleet.all(), runner.live_rooms(), now)
        if now >= next_progress:
            next_progress += PROGRESS_S
            print(f"soak {_clock(now - t0)}: {rec.progress(runner.records)}", file=sys.stderr, flush=True)
        if now >= end and not pending and all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.2)
    for t in tasks:
        t.result()  # a call's own failure is in its record; anything else is the generator's
    settle = time.monotonic() + SETTLE_S
    while time.monotonic() < settle:  # every slot and conversation let go
        await asyncio.to_thread(fleet.supervise)
        await asyncio.to_thread(rec.sample, fleet.all(), runner.live_rooms(), time.monotonic())
        if rec.settled():
            break
        await asyncio.sleep(SAMPLE_S)
    rec.final = rec.samples[-1]


def _progress(runner: CallRunner, rec: Recorder) -> tuple:
    """What the watchdog sees move: the calls (started, answered, ended, frames heard) and, once every call
    has ended, the samples of the slots being let go."""
    calls = runner.progress()
    return calls, len(rec.samples) if calls[0] and calls[0] == calls[2] else 0


def _stalled(report: str, args, fleet: Fleet, server, name: str) -> None:
    """(The watchdog's thread: the run's own may be stuck for good.) Kill the workers, keep their logs and
    the stacks, undo the phone number's setup, and say why on the last line; the watchdog then exits."""
    for w in fleet.every:
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
    (args.out / "stacks.txt").write_text(report + "\n")
    for i, w in enumerate(fleet.every):
        if w.log.exists():
            (args.out / f"worker-{i + 1}.log").write_bytes(w.log.read_bytes())
    agent_sip(server, "teardown", "--name", name, agent_name=name)
    why = report.split(";", 1)[0]
    print(json.dumps({"ok": False, "stalled": why, "checks": {"progress": {"ok": False, "detail": why}}}))


def _clock(s: float) -> str:
    return f"{int(s // 60):02d}:{int(s % 60):02d}"


if __name__ == "__main__":
    sys.exit(main())
