"""The simulation's run: one engine, the hotel's database, the rooms joining over a ramp, the measured talk,
the wind-down, and the figures it leaves in metrics.json.

It always ends: the whole run has a hard deadline, SIGTERM and Ctrl-C stop it with the figures so far, and the
engine, the rooms and the database are closed in every case. Knows the engine's snapshot and the rooms'
readings; nothing of what a room's script does (agent/sim/rooms.py) or how the summary is laid out
(agent/sim/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.phone.telephony import telephone_band
from agent.sim.engine_process import SimEngine
from agent.sim.error import SimulateError
from agent.sim.report import heap_mb, rss_mb, write_metrics
from agent.sim.rooms import Room, Stage, caller_clips, phone_rooms, run_room
from engine.api import EngineClosed
from engine.process.collector import freeze_long_lived, thaw

if TYPE_CHECKING:
    from engine.api import EngineSnapshot
    from engine.client.control import EngineFigures
    from engine.config.engine_config import EngineConfig
    from tools.hotel import Hotel

RSS_EVERY_S = 60.0  # resident memory is sampled this often during the talk (metrics.json "rss_mb")
GRACE_S = 30.0  # the hard deadline: ramp + join timeout + talk + this
JOIN_EVERY_S, MAX_RAMP_S = 0.25, 30.0  # rooms join this far apart, over at most this long
ENGINE_START_S = 600.0  # the engine's process is ready by then (CHORUS_STARTUP_TIMEOUT_S over it), or fails
SHOW_EVERY_S = 1.0  # the progress line is redrawn this often
# the rooms' figures summed over the rooms
TOTALS = (
    "scripted_turns",
    "scripted_calls",
    "function_calls",
    "tool_results",
    "resumes",
    "rejected_calls",
    "clips",
    "frames_pushed",
    "frames_in",
    "input_errors",
    "redials",
)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from the settings and the flags, or SimulateError with one line naming what is
    wrong."""
    try:
        # every engine setting of the environment (windows, capacity mode, ...), the flags over them
        return args.settings.engine_config(
            preset=args.preset,
            num_slots=args.slots,
            checkpoint=args.checkpoint,
            tokenizer=args.tokenizer,
            speaker=args.speaker,
            device=args.device,
            metrics_port=args.metrics_port,
        )
    except Exception as e:  # noqa: BLE001 (a setting the engine's config refuses: one line, not a traceback)
        raise SimulateError(f"cannot build the engine ({_named(args)}): {_first_line(e)}") from None


def start_engine(args: argparse.Namespace, config: EngineConfig) -> SimEngine:
    """The engine's process, started and ready, or SimulateError with one line (its own log, a corrupt
    checkpoint's or a missing device's, is on standard error above it, as a worker's engine's is in the
    worker's)."""
    try:
        return SimEngine.start(config, args.settings.startup_timeout_s or ENGINE_START_S)
    except EngineClosed as e:
        raise SimulateError(f"cannot build the engine ({_named(args)}): {_first_line(e)}") from None


def _named(args: argparse.Namespace) -> str:
    return f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--preset {args.preset}"


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def window_figures(figures: EngineFigures, ticks0: int, missed0: int, budget_ms: float) -> dict:
    """Live-step figures of the measured window only (the join phase's prompt prefill excluded), from the
    engine's figures at its end; the steps slower than the frame budget by index in the window."""
    snap = figures.snapshot
    n = snap.ticks - ticks0
    live_ms = figures.live_ms[-n:] if n > 0 else []

    def pct(q: float) -> float:
        return round(float(np.percentile(live_ms, q)), 2) if live_ms else 0.0

    return {
        "ticks": n,
        "live_ms_p50": pct(50),
        "live_ms_p99": pct(99),
        "live_ms_max": round(max(live_ms), 2) if live_ms else 0.0,
        "missed_deadlines": snap.missed_deadlines - missed0,
        "slow_live_steps": [[i, round(ms, 1)] for i, ms in enumerate(live_ms) if ms > budget_ms],
    }


class Run:
    """The rooms on one engine, from their ramp to their wind-down (see the module docstring)."""

    def __init__(
        self, args: argparse.Namespace, engine: SimEngine, hotel: Hotel, today: dt.date, out: Path
    ) -> None:
        self.args, self.engine = args, engine
        loop = asyncio.get_running_loop()
        clock = engine.clock
        phones = phone_rooms(args.rooms, args.phone_rooms)
        self.rooms = [Room(i, i < args.tool_rooms, i in phones, clock) for i in range(args.rooms)]
        clips = caller_clips(clock.input_rate)
        phone_clips = [telephone_band(c, clock.input_rate) for c in clips]
        # callers arrive one every JOIN_EVERY_S, as a phone line fills, not all in the same instant
        self.ramp = min(JOIN_EVERY_S * len(self.rooms), MAX_RAMP_S, args.seconds / 4)
        self.t_start = loop.time()
        join_by = self.t_start + self.ramp + args.join_timeout
        self.stage = Stage(engine, hotel, out, args.settings, today, join_by)
        starts = [self.t_start + self.ramp * i / len(self.rooms) for i in range(len(self.rooms))]
        self.tasks = [
            asyncio.create_task(run_room(r, self.stage, at, phone_clips if r.phone else clips))
            for r, at in zip(self.rooms, starts)
        ]
        self.tty = sys.stdout.isatty()
        self.join_s = 0.0
        self.rss: list[list[float]] = []  # the simulation's and its engine's processes' resident memory
        self.heap: list[list[float | None]] = []  # their C heap in use at the same moments
        self.snap0: EngineSnapshot | None = None  # the figures before the measured window

    async def show(self, phase: str, elapsed: float, total: float) -> EngineFigures:
        """The progress line, and the engine's figures it was drawn from."""
        figures = await self.engine.figures()
        line = progress(figures.snapshot, self.rooms, phase, elapsed, total)
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)
        return figures

    async def phases(self) -> str:
        """Join, then talk, within the hard deadline: "completed", "deadline" or "interrupted" (cancelled)."""
        a = self.args
        try:
            async with asyncio.timeout(self.ramp + a.join_timeout + a.seconds + GRACE_S):
                self.snap0 = (await self.engine.figures()).snapshot
                await self._join()
                await self._talk()
        except TimeoutError:
            return "deadline"
        except asyncio.CancelledError:  # Ctrl-C: stop here and report what ran
            return "interrupted"
        return "completed"

    async def _join(self) -> None:
        """Every room takes a slot and its prompt is prefilled, or is refused, or fails by
        the join deadline."""
        loop = asyncio.get_running_loop()
        while not all(r.live_at is not None or r.error or r.refused for r in self.rooms):
            await asyncio.wait(self.tasks, timeout=SHOW_EVERY_S)
            await self.show("join", loop.time() - self.t_start, self.ramp + self.args.join_timeout)
        self.join_s = loop.time() - self.t_start

    async def _talk(self) -> None:
        """The measured window: the rooms' scripts run until their end, resident memory sampled meanwhile."""
        loop = asyncio.get_running_loop()
        freeze_long_lived(again=True)  # the rooms, set up now
        await asyncio.sleep(0.2)  # the tick that waited for the collection is not the talk's
        self.snap0 = (await self.engine.figures()).snapshot
        t_go = loop.time()
        self.stage.end[0] = t_go + self.args.seconds
        self.stage.go.set()
        next_rss = t_go
        while not all(t.done() for t in self.tasks):
            await asyncio.wait(self.tasks, timeout=SHOW_EVERY_S)
            figures = await self.show("talk", loop.time() - t_go, self.args.seconds)
            if loop.time() >= next_rss:  # the processes' resident memory, once a minute
                self.rss.append([round(loop.time() - t_go), rss_mb(figures.rss_bytes)])
                self.heap.append([round(loop.time() - t_go), heap_mb(figures.heap_bytes)])
                next_rss += RSS_EVERY_S

    async def window(self) -> dict:
        snap0 = self.snap0
        figures = await self.engine.figures()
        if snap0 is None:  # stopped before the first question: the window is all the engine ran
            snap0 = figures.snapshot.model_copy(update={"ticks": 0, "missed_deadlines": 0})
            self.snap0 = snap0
        return window_figures(figures, snap0.ticks, snap0.missed_deadlines, self.engine.clock.frame_ms)

    async def wind_down(self, ended: str) -> tuple[EngineSnapshot, float]:
        """Stop the rooms and end their calls; the engine's figures of the run and the slots still
        in use after."""
        self.stage.stop.set()
        self.stage.go.set()
        if self.tty:
            print()
        if ended != "completed":
            print(f"simulate: {ended}; stopping the rooms and writing the figures so far", flush=True)
        snap = (await self.engine.figures()).snapshot  # before the rooms close: the run's own figures
        # the agents end their calls: what each has queued still plays (interrupted: cut at once)
        closing = [r.call.aclose(play_out=ended == "completed") for r in self.rooms if r.call is not None]
        await asyncio.gather(*closing, return_exceptions=True)
        for r in self.rooms:
            if r.call is not None:
                r.frames_in = r.call.handle.frames_in if r.call.handle is not None else 0
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return snap, await self.engine.occupancy_after()


def progress(snap: EngineSnapshot, rooms: list[Room], phase: str, elapsed: float, total: float) -> str:
    live = sum(1 for r in rooms if r.live_at is not None)
    refused = sum(1 for r in rooms if r.refused)
    calls = sum(r.call.duplex.stats["function_calls"] for r in rooms if r.call and r.call.duplex)
    return (
        f"[{phase} {elapsed:5.1f}/{total:.0f} s] rooms live {live:3d}/{len(rooms)}"
        + (f" ({refused} refused)" if refused else "")
        + f"  live step p50 {snap.live_ms_p50:5.1f} p99 {snap.live_ms_p99:5.1f} ms"
        f"  missed {snap.missed_deadlines}"
        f"  tool calls {calls}"
        + (f"  engine refusals {snap.refused_sessions}" if snap.refused_sessions else "")
        + ("  (overloaded)" if snap.overloaded else "")
    )


def _open_hotel(store_settings: Any) -> tuple[Any, Hotel, dt.date]:
    """The booking store (seeded for today) and the hotel on it; SimulateError naming the setting when it
    cannot be opened or written (an unreachable database, a folder that is a file), as the worker refuses to
    start on it."""
    from tools.hotel import Hotel
    from tools.seed import seed
    from tools.store import open_store

    quiet = logging.getLogger("tools")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the one line below says it; the store's own log would repeat it
    store = None
    try:
        if not store_settings.database_url:
            store_settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = open_store(store_settings)
        today = dt.date.today()
        seed(store, today)
    except Exception as e:  # noqa: BLE001 (one line, no traceback; the type only: a message may hold the URL)
        if store is not None:
            store.close()
        why = f"the booking store cannot be opened ({type(e).__name__})"
        raise SimulateError(f"{store_settings.setting}: {why}") from None
    finally:
        quiet.setLevel(level)
    return store, Hotel(store), today


def _announce(engine: SimEngine, port: int | None, store_settings: Any) -> None:
    if port is not None:  # the monitoring page can watch the run (docs/monitoring.md)
        url = f"http://{engine.config.metrics_host}:{port}/snapshot"
        where = "" if store_settings.database_url else f" CHORUS_DATA_DIR={store_settings.data_dir}"
        print(
            f"engine snapshot at {url}; watch it with: CHORUS_MONITOR_URLS={url}{where} python -m ui",
            flush=True,
        )


def _cancel_on_signals() -> None:
    """SIGTERM stops the run as Ctrl-C does: the figures so far are written."""
    main_task = asyncio.current_task()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell may start a job with it ignored
            asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)


def _metrics(
    args: argparse.Namespace,
    run: Run,
    ended: str,
    window: dict,
    snap: EngineSnapshot,
    per_room: list[dict],
    after: dict,
) -> dict:
    """The summary: the run's arguments, its phases, the engine's figures, the rooms' totals and what was left
    after (`after`: bookings made, slots in use)."""
    s0 = run.snap0
    assert s0 is not None  # set by `Run.window`, at the latest
    return {
        **{k: getattr(args, k) for k in ("rooms", "tool_rooms", "phone_rooms", "seconds", "preset")},
        "device": snap.device,
        "slots": args.slots,
        "ended": ended,
        "join_s": round(run.join_s, 1),
        "rooms_live": sum(1 for p in per_room if p["live"]),
        "rooms_refused": sum(1 for p in per_room if p["refused"]),
        **window,
        "missed_deadlines_join": s0.missed_deadlines,
        "missed_deadlines_total": snap.missed_deadlines,
        **{k: getattr(snap, k) for k in ("overruns", "slipped_ticks", "dropped_frames", "skipped_frames")},
        "underruns": snap.underruns,
        "engine_tool_calls": snap.tool_calls,
        "tool_call_ms_p50": snap.tool_call_ms_p50,
        "resume_ms_p50": snap.resume_ms_p50,
        **{k: sum(p[k] for p in per_room) for k in TOTALS},
        "bookings_made": after["bookings"],
        "speech_s": round(sum(p["speech_s"] for p in per_room), 1),
        "clip_s": round(sum(p["clip_s"] for p in per_room), 1),
        "room_errors": sum(1 for p in per_room if p["error"]),
        "occupancy_after": after["occupancy"],
        "tool_calls_scripted": True,
        "out": str(Path(args.out)),
    }


async def simulate(args: argparse.Namespace) -> dict:
    """Run the simulation `args` describe (checked by `check_arguments`); its summary,
    also in metrics.json."""
    config = engine_config(args)
    store, hotel, today = _open_hotel(args.store)  # before anything is written
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bookings_before = len(hotel.reservations())
    try:
        # the engine in a process of its own, its rooms through its door: as a worker's engine and rooms
        engine = await asyncio.to_thread(start_engine, args, config)
    except SimulateError:
        store.close()
        raise
    try:
        _announce(engine, (await engine.figures()).port, args.store)
        _cancel_on_signals()
        run = Run(args, engine, hotel, today, out)
    except BaseException:
        engine.close()
        store.close()
        raise
    ended = "completed"
    try:
        ended = await run.phases()
    finally:
        window = await run.window()
        snap, occupancy_after = await run.wind_down(ended)
        engine.close()
        bookings = len(hotel.reservations()) - bookings_before
        store.close()
        thaw()
    per_room = [r.figures(ended) for r in run.rooms]
    after = {"bookings": bookings, "occupancy": occupancy_after}
    metrics = _metrics(args, run, ended, window, snap, per_room, after)
    slow_live_steps = metrics.pop("slow_live_steps")
    write_metrics(out, metrics, slow_live_steps, run.rss, run.heap, per_room, snap.model_dump())
    return metrics
