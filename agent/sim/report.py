"""What `python -m agent simulate` reports: the summary table, metrics.json, the exit code, and the resident
memory it samples. Knows the simulation's metrics dictionary; nothing of rooms, sessions or the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

EXIT_INTERRUPTED = 130
# the tick's figures among those the simulation's last line carries (agent/sim/run.py), as a run's summary
# picks them
TICK_FIGURES = (
    "ticks",
    "live_ms_p50",
    "live_ms_p99",
    "live_ms_max",
    "missed_deadlines",
    "overruns",
    "slipped_ticks",
    "dropped_frames",
    "skipped_frames",
    "underruns",
)


def rss_mb(engine_bytes: int) -> float:
    """The simulation's resident memory in MiB: this process's (Linux /proc; 0 where it is not available) and
    its engine's process's `engine_bytes`."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        pages = 0
    return round((pages * os.sysconf("SC_PAGE_SIZE") + engine_bytes) / 2**20, 1)


def heap_mb(engine_bytes: int | None) -> float | None:
    """Bytes the C heap has handed out and not had back, in MiB, in this process and its engine's process
    (`engine_bytes`) together (`engine.process.malloc.heap_bytes`; None where the C library is not glibc)."""
    from engine.process.malloc import heap_bytes

    used = heap_bytes()
    return None if used is None or engine_bytes is None else round((used + engine_bytes) / 2**20, 1)


def exit_code(m: dict) -> int:
    """0 only when every room went live, none failed and every scripted tool call was answered."""
    if m["ended"] == "interrupted":
        return EXIT_INTERRUPTED
    ok = (
        m["ended"] == "completed"
        and m["rooms_live"] == m["rooms"]
        and m["room_errors"] == 0
        and m["tool_results"] == m["scripted_calls"] == m["resumes"]
    )
    return 0 if ok else 1


def write_metrics(
    out: Path, summary: dict, slow_live_steps: list, rss: list, heap: list, rooms: list[dict], engine: dict
) -> None:
    """metrics.json: the summary (the JSON line printed last), the live steps slower than the frame budget,
    the memory samples, one line per room and the engine's last snapshot."""
    figures = {"summary": summary, "slow_live_steps": slow_live_steps, "rss_mb": rss, "heap_mb": heap}
    (out / "metrics.json").write_text(json.dumps({**figures, "rooms": rooms, "engine": engine}, indent=1))


def print_summary(m: dict, budget_ms: int) -> None:
    """The summary table; `budget_ms` is the engine's frame, the live step's budget."""
    rows = [
        ("rooms (tool rooms, phone rooms)", f"{m['rooms']} ({m['tool_rooms']}, {m.get('phone_rooms', 0)})"),
        ("engine", f"{m['preset']} on {m['device']}, {m['slots']} slots"),
        ("run", m["ended"]),
        (
            "rooms live / refused / failed",
            f"{m['rooms_live']} / {m['rooms_refused']} / {m['room_errors']} "
            f"({m['redials']} waits for headroom)",
        ),
        (
            "join (slots + prompt prefill)",
            f"{m['join_s']:.1f} s, {m['missed_deadlines_join']} missed deadlines",
        ),
        ("measured window", f"{m['seconds']:.0f} s, {m['ticks']} ticks"),
        (
            "live step p50 / p99 / max",
            f"{m['live_ms_p50']:.1f} / {m['live_ms_p99']:.1f} / {m['live_ms_max']:.1f} ms "
            f"(budget {budget_ms})",
        ),
        (
            "missed deadlines",
            f"{m['missed_deadlines']} (overruns {m['overruns']}, slipped ticks {m['slipped_ticks']})",
        ),
        (
            "caller frames pushed / received",
            f"{m['frames_pushed']} / {m['frames_in']} ({m['input_errors']} forwarding errors)",
        ),
        (
            "dropped / skipped frames, underruns",
            f"{m['dropped_frames']} / {m['skipped_frames']}, {m['underruns']}",
        ),
        (
            "tool calls (scripted, forced)",
            f"{m['scripted_calls']} forced, {m['function_calls']} run, {m['tool_results']} answered, "
            f"{m['resumes']} resumed",
        ),
        ("bookings made by the tools", str(m["bookings_made"])),
        ("tool call / resume p50", f"{m['tool_call_ms_p50']:.0f} / {m['resume_ms_p50']:.0f} ms"),
        ("agent turns (scripted)", f"{m['scripted_turns']}, {m['speech_s']:.1f} s of agent speech played"),
        ("acknowledgement clips", f"{m['clips']}, {m['clip_s']:.1f} s played"),
        ("slots in use after", f"{m['occupancy_after']:.2f}"),
        ("output", f"{m['out']}/room_*.wav, metrics.json"),
    ]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40))
