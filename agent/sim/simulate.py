"""The embedded default main job: N virtual rooms, each a real `AgentSession`, all on one engine, no server.
The engine runs in a process of its own and the rooms reach it through its door, as a worker's do.

Callers are WAV utterances played in real time; each room's agent audio is written to its own WAV. With
dummy weights the model decides nothing, so agent turns and tool calls are scripted by teacher forcing
(the text channel for replies, the function channel for calls: reported as scripted); the hotel tools then
really run against the database. Prints a live progress line, a summary table, and one JSON line last.

It always ends: a room the engine refuses (no slot, no headroom) is reported in one line, a room not live by
the join deadline is a failure, the whole run has a hard deadline, and Ctrl-C stops it with the figures so
far. `metrics.json` is written in every case; the exit code is 0 only when every room went live, no room
failed and every scripted tool call was answered.

This module is the command line (arguments, settings, exit code); the rooms are agent/sim/rooms.py, the run
agent/sim/run.py, the report agent/sim/report.py. It knows nothing of sessions or the engine's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from agent.sim.error import SimulateError
from agent.sim.report import EXIT_INTERRUPTED, exit_code, print_summary
from engine.api import EngineFull

__all__ = [
    "SimulateError",
    "add_arguments",
    "check_arguments",
    "exit_code",
    "main",
]


def __getattr__(name: str) -> Any:
    """`simulate` and `engine_config`, from agent/sim/run.py when first asked for: a bad argument is answered
    before the rooms' modules (livekit-agents among them) are loaded."""
    if name in ("simulate", "engine_config"):
        from agent.sim import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rooms", type=int, default=64, help="virtual rooms (default 64)")
    p.add_argument(
        "--tool-rooms",
        type=int,
        default=None,
        help="rooms that make scripted tool calls (default: a quarter)",
    )
    p.add_argument(
        "--phone-rooms",
        type=int,
        default=None,
        help="rooms whose callers are on the phone: 8 kHz mu-law audio, the phone concierge "
        "(default: a quarter)",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="how long each room's call lasts (default 60)")
    p.add_argument("--preset", help="engine preset (default: CHORUS_PRESET, else tiny)")
    p.add_argument("--checkpoint", help="weights to load (default: CHORUS_CHECKPOINT, else dummy weights)")
    p.add_argument("--tokenizer", help="the thinker's tokenizer.json or folder (default: CHORUS_TOKENIZER)")
    p.add_argument("--speaker", help="speaker latent of the checkpoint (default: CHORUS_SPEAKER, else Aria)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CHORUS_DEVICE, else cuda if any)")
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="engine slots (default: one per room, at most 64); rooms beyond them are refused",
    )
    p.add_argument(
        "--join-timeout", type=float, default=60.0, help="seconds a room may take to go live (default 60)"
    )
    p.add_argument("--out", default="out/simulate", help="output folder: one WAV per room and metrics.json")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the engine's /snapshot and /metrics on 127.0.0.1 during the run, for the monitoring page "
        "(0: any free port, printed at the start; default: CHORUS_METRICS_PORT, else not served)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Fill the defaults from the settings and the other arguments; SimulateError naming the first bad value.
    Every setting is checked, also those the simulation does not use (CHORUS_SLOTS), as the worker would."""
    from agent.settings import AgentSettings
    from agent.startup import listen_problem
    from engine.config.presets import PRESETS
    from envsettings import SettingsError
    from tools.settings import StoreSettings

    try:
        settings, store = AgentSettings.from_env(), StoreSettings.from_env()
    except SettingsError as e:
        raise SimulateError(str(e)) from None
    args.settings = settings
    args.preset = args.preset or settings.preset
    args.checkpoint = args.checkpoint or settings.checkpoint
    args.tokenizer = args.tokenizer or settings.tokenizer
    args.speaker = args.speaker or settings.speaker
    args.device = args.device or settings.device
    named = "--metrics-port" if args.metrics_port is not None else "CHORUS_METRICS_PORT"
    if args.metrics_port is None:
        args.metrics_port = settings.metrics_port
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise SimulateError(f"--metrics-port {args.metrics_port}: give 0 (any free port) to 65535")
    if args.metrics_port and (problem := listen_problem(args.metrics_port, "127.0.0.1")):
        raise SimulateError(f"{named}: {problem}")  # before the engine is built, as the worker checks it
    # bookings go to the configured database, else to a fresh SQLite file beside the run's output
    if not store.database_url and "data_dir" not in store.model_fields_set:
        store = store.model_copy(update={"data_dir": Path(args.out) / "data"})
    args.store = store
    if args.rooms < 1:
        raise SimulateError(f"--rooms {args.rooms}: give at least 1")
    if args.tool_rooms is None:
        args.tool_rooms = args.rooms // 4
    if not 0 <= args.tool_rooms <= args.rooms:
        raise SimulateError(f"--tool-rooms {args.tool_rooms}: give 0 to {args.rooms} (at most --rooms)")
    if args.phone_rooms is None:
        args.phone_rooms = args.rooms // 4
    if not 0 <= args.phone_rooms <= args.rooms:
        raise SimulateError(f"--phone-rooms {args.phone_rooms}: give 0 to {args.rooms} (at most --rooms)")
    if not args.seconds > 0:
        raise SimulateError(f"--seconds {args.seconds:g}: give a positive number")
    if not args.join_timeout > 0:
        raise SimulateError(f"--join-timeout {args.join_timeout:g}: give a positive number")
    if args.slots is None:
        args.slots = min(args.rooms, 64)
    if not 1 <= args.slots <= 4096:
        raise SimulateError(f"--slots {args.slots}: give 1 to 4096")
    if args.checkpoint and not Path(args.checkpoint).exists():
        raise SimulateError(f"--checkpoint {args.checkpoint}: no such file or folder")
    if args.preset not in PRESETS:
        raise SimulateError(f"--preset {args.preset}: unknown; choose one of {', '.join(sorted(PRESETS))}")


def main(args: argparse.Namespace) -> int:
    from engine.config.presets import load_preset

    try:
        check_arguments(args)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        # a refused room is reported in one line by `join`; the framework's closing error says it again. And a
        # tool's refusal (the hotel saying no to a scripted call: a date past the horizon, a room sold out) is
        # the tool's answer, which the caller hears and the summary counts: not a warning of the run's
        logging.getLogger("livekit.agents").addFilter(
            lambda r: (
                not (r.exc_info and isinstance(r.exc_info[1], EngineFull))
                and r.msg != "ToolError while executing tool"
            )
        )
        from agent.sim.run import simulate

        metrics = asyncio.run(simulate(args))
    except SimulateError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during the wind-down
        print("simulate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print_summary(metrics, budget_ms=load_preset(args.preset).clock.frame_ms)
    print(json.dumps(metrics))
    return exit_code(metrics)
