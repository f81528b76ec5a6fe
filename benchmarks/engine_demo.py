"""`python -m benchmarks.engine_demo`: the engine demo, many conversations on one engine and then the figures.

A quarter of the sessions call tools (forced calls: dummy weights decide nothing); the workload is the
capacity benchmark's (benchmarks/engine_serve.py). Last line: one JSON object. Knows the engine; nothing of
LiveKit.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.engine_bench import TICK_MS
from benchmarks.engine_serve import run_workload
from engine.config.presets import PRESETS
from engine.tick.engine import EngineConfig


def demo(preset: str, sessions: int, seconds: float, device_name: str | None) -> int:
    """`sessions` conversations on the wall clock, a quarter of them calling tools, then the figures."""
    cfg = EngineConfig(preset=preset, num_slots=sessions, device=device_name)
    print(
        f"Chorus engine demo: {sessions} sessions ({sessions // 4} calling tools), {seconds:g} s, "
        f"preset {preset}, dummy weights",
        flush=True,
    )
    r = run_workload(
        cfg,
        sessions,
        sessions // 4,
        seconds,
        call_tokens=40,
        result_tokens=200,
        tool_latency_s=0.3,
        call_every_s=2.0,
    )
    r.pop("tick_series")
    print(
        f"live step p50 {r['live_ms_p50']} ms, p99 {r['live_ms_p99']} ms (tick: {TICK_MS:g} ms); "
        f"missed deadlines {r['missed_deadlines']}; tool calls {r['tool_calls']} "
        f"({r['tool_call_ticks_p50']} ticks p50)"
    )
    print(json.dumps({"preset": preset, "sessions": sessions, "seconds": seconds, **r}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_demo", description=__doc__)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args(argv)
    return demo(args.preset, args.sessions, args.seconds, args.device)


if __name__ == "__main__":
    sys.exit(main())
