"""How long a caller is left alone when the agent serving them is lost, through a real LiveKit server and its
Redis: per fault, the silence from the fault to the new agent's voice, and whether the new agent carried the
conversation on.

`python -m benchmarks.fleet_faults --calls 8 --rounds 1` runs, for each fault and round, `calls` calls at once
on two fresh workers (`python -m agent start`, tiny preset, CPU, `calls` slots each so that one can take them
all, teacher forcing so the agents speak): once every caller has heard their agent, the worker serving the
most of them is hit by the fault:
  - `worker SIGKILL`: the worker's process killed;
  - `engine SIGKILL`: the worker's engine's process killed (the worker lives on and starts it again);
  - `job crash`: one room's own job process killed (CHORUS_ROOM_PROCESSES=true): one call is hit;
  - `drain`: SIGTERM, the worker drains and hands its calls over (a rolling restart's step).
Per fault, over the calls it hit: seconds from the fault to the first audible frame of the new agent's voice
at the caller (`to_new_voice_s`, p50 / p99 / max: the caller's silence, except on a drain, where the draining
agent talks on until the new one is live; there `handover_gap_s` is the silence, from the draining agent
leaving to the new one's voice), how many calls heard the new agent acknowledge the break (the conversation
resumed: prompts/resumed_greeting.md or prompts/handover_greeting.md), how many had exactly one new agent, and
`untouched`: the calls on the other worker that heard no other agent.

A run that hangs fails instead: once no caller has heard a frame for `--stall-s` (60 s) while calls are on,
the workers are killed, every thread's stack is written to stderr, the last line is JSON with "ok": false
and the process exits with status 3 (testkit/watchdog.py).

Needs the server of scripts/livekit.sh with its Redis (start_livekit, inside a namespace made by netns_up):
the environment's CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET and CHORUS_TEST_LIVEKIT_REDIS. The last line is
one JSON object. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from testkit.callers import frames_heard
from testkit.fleet import FAULTS, fault_on_calls, two_workers
from testkit.server import server_from_env
from testkit.watchdog import STALL_S, Watchdog
from testkit.worker import seeded

ACKNOWLEDGED = ("sorry, we were", "thank you for holding")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet_faults", description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=8, help="calls at once on the two workers (default 8)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per fault (default 1)")
    ap.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)} (default all)"
    )
    ap.add_argument(
        "--stall-s", type=float, default=STALL_S, help="fail once no caller heard audio so long (default 60)"
    )
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or args.rounds < 1 or args.calls < 1 or not args.stall_s > 0:
        ap.error(
            f"unknown faults {unknown}" if unknown else "--rounds and --calls at least 1, --stall-s above 0"
        )
    server = server_from_env(ap.prog, confined=True)
    if not server.redis:
        raise SystemExit(f"{ap.prog}: the server runs without Redis (set CHORUS_TEST_LIVEKIT_REDIS)")
    report: dict = {"preset": "tiny", "calls": args.calls, "rounds": args.rounds, "faults": {}}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chorus-fleet-") as tmp:
        store_dir = Path(tmp)
        seeded(store_dir)
        for fault in faults:
            hit, env = FAULTS[fault]
            silences, gaps, resumed, single, untouched, missed = [], [], 0, 0, 0, 0
            for i in range(args.rounds):
                name = f"chorus-bench-{uuid.uuid4().hex[:8]}"
                with (
                    two_workers(server, store_dir, name, slots=args.calls, **env) as stack,
                    Watchdog(  # armed while calls are on: the workers' start is bounded by their own wait
                        frames_heard,
                        args.stall_s,
                        what="no caller's audio",
                        on_stall=lambda report, workers=stack.workers: _stalled(report, workers),
                    ),
                ):
                    got = asyncio.run(
                        fault_on_calls(
                            server, stack.workers, name, hit, args.calls, one_call=fault == "job crash"
                        )
                    )
                for c in got:
                    if not c["hit"]:
                        untouched += not c["new_speakers"]
                        continue
                    if c["after_s"] is None:
                        missed += 1
                        continue
                    said = " ".join(c["said"]).lower()
                    silences.append(c["after_s"])
                    if c["gap_s"] is not None:
                        gaps.append(c["gap_s"])
                    resumed += any(a in said for a in ACKNOWLEDGED)
                    single += c["new_speakers"] == {c["agent"]}
                hits = [c for c in got if c["hit"]]
                print(
                    f"{fault} {i + 1}/{args.rounds}: {len(hits)} of {len(got)} calls hit, new agents heard "
                    f"{sorted(round(c['after_s'], 2) for c in hits if c['after_s'] is not None)} s after it",
                    file=sys.stderr,
                    flush=True,
                )
            report["faults"][fault] = {
                "to_new_voice_s": _spread(silences) if silences else None,
                **({"handover_gap_s": _spread(gaps)} if fault == "drain" and gaps else {}),
                "calls_hit": len(silences) + missed,
                "no_new_agent": missed,
                "resumed": resumed,
                "one_new_agent": single,
                "untouched": untouched,
            }
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(report))


def _stalled(report: str, workers) -> None:
    """(The watchdog's thread: the run's own may be stuck for good.) Kill the workers and say why on the last
    line; the watchdog has written every thread's stack and then exits."""
    for w in workers:
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
    print(json.dumps({"ok": False, "stalled": report.split(";", 1)[0]}), flush=True)


def _spread(values: list[float]) -> dict:
    """p50, p99 and max to the hundredth (the silences are a few seconds)."""
    import numpy as np

    v = np.asarray(values)
    return {
        k: round(float(x), 2)
        for k, x in (("p50", np.percentile(v, 50)), ("p99", np.percentile(v, 99)), ("max", v.max()))
    }


if __name__ == "__main__":
    main()
