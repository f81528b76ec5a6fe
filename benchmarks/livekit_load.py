"""LiveKit's own agent load tester against a Chorus worker, through a real LiveKit server.

`python -m benchmarks.livekit_load --rooms 4 --seconds 40` starts the worker as a user does (`python -m agent
start`, tiny preset, one slot per room) and runs LiveKit's agent load tester (scripts/agent-load-test: the
livekit-cli module's loadtester, the code of `lk perf agent-load-test`) with `--rooms N --agent-name ...
--echo-speech-delay ... --duration ...`. For each room the tester joins as `echo-participant`, dispatches the
agent and waits for it to join before it opens the next room; it plays the agent's own audio back after the
echo delay, so the agent must speak first: the worker runs with CHORUS_TEACHER_FORCING=true (the greeting and
replies are forced on the model's text channel; dummy weights decide nothing). Its table reports dispatch,
join and subscription only. Beside it this prints the worker's own figures for the same run: the live step's
p50 and p99, missed deadlines, and per room the caller frames the engine received and consumed.

Needs the server of scripts/livekit.sh (start_livekit, inside a namespace made by netns_up) and the load
tester built by ensure_livekit. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.server import load_tester, server_from_env
from testkit.worker import Worker, seeded

PROG = "livekit_load"


def run(rooms: int, seconds: float, echo_delay: float, tmp: Path) -> dict:
    server = server_from_env(PROG)
    seeded(tmp)
    with Worker(server, tmp, slots=rooms) as worker:
        t0 = time.monotonic()
        ticks0 = worker.snapshot()["ticks"]
        cmd = [
            load_tester(PROG),
            "--rooms",
            str(rooms),
            "--agent-name",
            worker.agent_name,
            "--echo-speech-delay",
            f"{echo_delay}s",
            "--duration",
            f"{seconds}s",
            "--url",
            server.url,
            "--api-key",
            server.key,
            "--api-secret",
            server.secret,
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: dict[str, dict] = {}  # each room's latest figures while it was live
        snap = worker.snapshot()
        while proc.poll() is None:
            snap = worker.snapshot()
            for s in snap["sessions"]:
                seen[s["label"]] = s
            if time.monotonic() - t0 > seconds + 120:
                proc.kill()
            time.sleep(1.0)
        table = proc.stdout.read()
        wall = time.monotonic() - t0
    out = proc
    sessions = sorted(seen.values(), key=lambda s: s["label"])
    return {
        "rooms": rooms,
        "seconds": seconds,
        "echo_speech_delay_s": echo_delay,
        "load_tester_exit": out.returncode,
        "load_tester_output": table,
        "agents_joined": len(sessions),
        "wall_s": round(wall, 1),
        "ticks": snap["ticks"] - ticks0,
        "live_ms_p50": snap["live_ms_p50"],
        "live_ms_p99": snap["live_ms_p99"],
        "missed_deadlines": snap["missed_deadlines"],
        "dropped_frames": snap["dropped_frames"],
        "per_room": [
            {
                "room": s["label"],
                "frames_in": s["frames_in"],
                "frames_consumed": s["frames_consumed"],
                "underruns": s["underruns"],
                "age_s": s["age_s"],
            }
            for s in sessions
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.livekit_load", description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, default=4)
    p.add_argument("--seconds", type=float, default=40.0, help="the load tester's --duration")
    p.add_argument("--echo-speech-delay", type=float, default=2.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="chorus-lk-load-") as tmp:
        result = run(args.rooms, args.seconds, args.echo_speech_delay, Path(tmp))
    print(result["load_tester_output"].rstrip())
    print(
        f"worker: live step p50 {result['live_ms_p50']:.1f} ms, p99 {result['live_ms_p99']:.1f} ms, "
        f"missed deadlines {result['missed_deadlines']}, dropped frames {result['dropped_frames']}"
    )
    for r in result["per_room"]:
        print(
            f"  {r['room']}: frames in {r['frames_in']}, consumed {r['frames_consumed']}, "
            f"age {r['age_s']:.0f} s"
        )
    summary = {k: v for k, v in result.items() if k != "load_tester_output"}
    print(json.dumps(summary))
    return 0 if result["load_tester_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
