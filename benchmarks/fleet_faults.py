"""How long a caller is left alone when the agent serving them is lost, through a real LiveKit server and its
Redis: per fault, the silence from the fault to the new agent's voice, and whether the new agent carried the
conversation on.

`python -m benchmarks.fleet_faults --rounds 3` runs, for each fault, `rounds` calls, each on two fresh workers
(`python -m agent start`, tiny preset, CPU, 2 slots, teacher forcing so the agents speak): once the caller
has heard the agent, the worker serving it is hit by the fault:
  - `worker SIGKILL`: the worker's process killed;
  - `engine SIGKILL`: the worker's engine's process killed (the worker lives on and starts it again);
  - `job crash`: the room's own job process killed (CHORUS_ROOM_PROCESSES=true);
  - `drain`: SIGTERM, the worker drains and hands its call over (a rolling restart's step).
Per fault: seconds from the fault to the first audible frame of the new agent's voice at the caller
(`to_new_voice_s`, p50 / p99 / max: the caller's silence, except on a drain, where the draining agent talks on
until the new one is live; there `handover_gap_s` is the silence, from the draining agent leaving to the new
one's voice), how many calls heard the new agent acknowledge the break (the conversation
resumed: prompts/resumed_greeting.md or prompts/handover_greeting.md) and how many had exactly one new agent.

Needs the server of scripts/livekit.sh with its Redis (start_livekit, inside a namespace made by netns_up):
the environment's CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET and CHORUS_TEST_LIVEKIT_REDIS. The last line is
one JSON object. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.support.fleet import FAULTS, one_fault, two_workers
from benchmarks.support.server import server_from_env
from benchmarks.support.worker import seeded

ACKNOWLEDGED = ("sorry, we were", "thank you for holding")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet_faults", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="calls per fault (default 3)")
    ap.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)} (default all)"
    )
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or args.rounds < 1:
        ap.error(f"unknown faults {unknown}" if unknown else "--rounds must be at least 1")
    server = server_from_env(ap.prog, confined=True)
    if not server.redis:
        raise SystemExit(f"{ap.prog}: the server runs without Redis (set CHORUS_TEST_LIVEKIT_REDIS)")
    report: dict = {"preset": "tiny", "rounds": args.rounds, "faults": {}}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chorus-fleet-") as tmp:
        store_dir = Path(tmp)
        seeded(store_dir)
        for fault in faults:
            hit, env = FAULTS[fault]
            silences, gaps, resumed, single = [], [], 0, 0
            for i in range(args.rounds):
                name = f"chorus-bench-{uuid.uuid4().hex[:8]}"
                with two_workers(server, store_dir, name, **env) as stack:
                    got = asyncio.run(one_fault(server, stack.workers, name, hit))
                said = " ".join(got["said"]).lower()
                silences.append(got["after_s"])
                if got["gap_s"] is not None:
                    gaps.append(got["gap_s"])
                resumed += any(a in said for a in ACKNOWLEDGED)
                single += got["speakers"] == {got["agent"]}
                print(
                    f"{fault} {i + 1}/{args.rounds}: new agent heard {got['after_s']:.2f} s after the fault; "
                    f"said {got['said'][:2]}",
                    file=sys.stderr,
                    flush=True,
                )
            report["faults"][fault] = {
                "to_new_voice_s": _spread(silences),
                **({"handover_gap_s": _spread(gaps)} if fault == "drain" and gaps else {}),
                "resumed": resumed,
                "one_new_agent": single,
            }
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(report))


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
