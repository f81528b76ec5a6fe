"""The embedded default main job: N virtual rooms, each a real `AgentSession`, all on one engine, no server.

Callers are WAV utterances played in real time; each room's agent audio is written to its own WAV. With
dummy weights the model decides nothing, so agent turns and tool calls are scripted by teacher forcing
(the text channel for replies, the function channel for calls: reported as scripted); the hotel tools then
really run against the database. Prints a live progress line, a summary table, and one JSON line last.

It always ends: a room the engine refuses (no slot, no headroom) is reported in one line, a room not live by
the join deadline is a failure, the whole run has a hard deadline, and Ctrl-C stops it with the figures so
far. `metrics.json` is written in every case; the exit code is 0 only when every room went live, no room
failed and every scripted tool call was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import logging
import random
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.call import Call, PcmInput, quiet_gc, read_wav, start_call
from agent.forcing import REPLIES, Forcing
from agent.playout import WavSink
from agent.sim_report import EXIT_INTERRUPTED, exit_code, heap_mb, print_summary, rss_mb
from agent.telephony import PHONE_RATE, telephone_band
from engine.api import EngineFull, EngineOverloaded
from prompts import PROMPTS_DIR

if TYPE_CHECKING:
    from engine.engine import Engine
    from tools.hotel import Hotel

log = logging.getLogger("chorus.agent.simulate")

CALLER_WAVS = sorted((PROMPTS_DIR / "callers").glob("caller_*.wav"))
UTTERANCE_EVERY_S = 6.0
TOOL_EVERY_S = 12.0
LAST_CALL_S = 4.0  # no scripted call starts this close to the end of the window
DRAIN_S = 20.0  # after the window, calls still on their way get this long to be answered and resumed
REDIAL_S = 1.0  # a room held back for lack of headroom tries again after this, then
REDIAL_MAX_S = 8.0  # after twice as long each time, up to this
RSS_EVERY_S = 60.0  # resident memory is sampled this often during the talk (metrics.json "rss_mb")
GRACE_S = 30.0  # the hard deadline: ramp + join timeout + talk + this
JOIN_EVERY_S, MAX_RAMP_S = 0.25, 30.0  # rooms join this far apart, over at most this long


class SimulateError(Exception):
    """A bad argument or an engine that cannot be built: one line for the user, no traceback."""


SURNAMES = ["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Gum", "Hazel", "Ivy", "Juniper", "Kauri",
            "Larch", "Maple", "Nutmeg", "Oak", "Pine"]  # fmt: skip


def tool_script(today: dt.date, room: int, phone: bool = False) -> list[dict]:
    """The calls a tool room makes in turn: real tools, real arguments, run against the database. A phone
    room's are the phone concierge's: the booking's contact left to the caller's number, the lookup through
    `manage_reservation`."""
    check_in = today + dt.timedelta(days=7 + room % 20)
    guest = f"Sim {SURNAMES[room % len(SURNAMES)]}"
    out = check_in + dt.timedelta(days=2)
    booking = {"guest_name": guest, "contact": f"sim{room}@example.com", "check_in": check_in.isoformat(),
               "check_out": out.isoformat(), "guests": 2, "room_type": "standard"}  # fmt: skip
    lookup = {"confirmation_code": "ZZZZ2222", "last_name": "Nobody"}
    if phone:
        del booking["contact"]
    return [
        {"name": "check_availability",
         "arguments": {"check_in": check_in.isoformat(), "check_out": out.isoformat(), "guests": 2}},
        {"name": "hotel_info", "arguments": {"topic": "parking"}},
        {"name": "book_room", "arguments": booking},
        {"name": "manage_reservation", "arguments": {**lookup, "action": "find"}} if phone
        else {"name": "find_reservation", "arguments": lookup},
    ]  # fmt: skip


def phone_rooms(rooms: int, phones: int) -> set[int]:
    """Which rooms are phone callers: every fourth from the second (so the tool rooms, the first ones, have
    some), then the rest in order, `phones` in all."""
    order = [*range(1, rooms, 4), *(i for i in range(rooms) if i % 4 != 1)]
    return set(order[:phones])


def caller_clips() -> list[np.ndarray]:
    """16 kHz caller utterances: the committed test WAVs, or band-limited noise bursts if they are absent."""
    clips = []
    for path in CALLER_WAVS:
        pcm, rate = read_wav(path)
        if rate == 16_000:
            clips.append(pcm)
    if not clips:
        rng = np.random.default_rng(0)
        for n in (2.0, 2.5, 3.0):
            noise = np.convolve(rng.standard_normal(int(16_000 * n)), np.ones(8) / 8, mode="same")
            clips.append((noise * 6000).astype(np.int16))
    return clips


class Room:
    def __init__(self, index: int, tool_room: bool, phone: bool = False) -> None:
        self.index = index
        self.tool_room = tool_room
        self.phone = phone  # a phone caller: 8 kHz mu-law audio, the phone concierge
        self.call: Call | None = None
        self.input = PcmInput(sample_rate=PHONE_RATE if phone else 16_000)
        self.scripted_calls = 0
        self.scripted_turns = 0
        self.error: str | None = None  # the room failed (reported, counted, exit code 1)
        self.refused: str | None = None  # the engine refused the room (no slot or no headroom)
        self.redials = 0  # times the room was held back for lack of headroom and tried again
        self.live_at: float | None = None
        self.frames_in = 0  # caller frames the engine received (from its snapshot at the end)

    @property
    def name(self) -> str:
        return f"room_{self.index:03d}"

    @property
    def number(self) -> str:
        """A phone room's caller's number: fictional (+1 555 01xx is reserved for fiction)."""
        return f"+1555010{self.index % 10_000:04d}"


async def join(
    room: Room, engine: Engine, hotel: Hotel, out: Path, join_by: float, stop: asyncio.Event, settings: Any
) -> Any:
    """The room's call on an open engine slot, or None with `room.refused` set. As LiveKit's dispatcher does
    with a worker whose load is full, a room waits (backing off) while the engine reports no headroom, until
    `join_by`; a room that finds every slot taken is refused at once (there is no other worker here)."""
    from agent.hotel import HotelAgent
    from agent.phone import PhoneConcierge, PhoneLine

    loop = asyncio.get_running_loop()
    wait = REDIAL_S
    while True:
        refusal: Exception | None = None
        if engine.occupancy >= 1.0:  # no other worker to send the room to
            refusal = EngineFull(f"all {engine.config.num_slots} slots are in use")
        elif engine.overloaded:
            refusal = EngineOverloaded("the engine reported no headroom until the join deadline")
        else:
            key = f"sim-{room.name}-{time.time_ns()}"
            if room.phone:
                line = PhoneLine(settings, room=room.name, identity=f"sip_{room.name}", number=room.number)
                agent = PhoneConcierge(hotel, line, session_key=key)
            else:
                agent = HotelAgent(hotel, session_key=key)
            room.call = call = await start_call(
                engine, agent, sink=WavSink(out / f"{room.name}.wav", 22_050), audio_input=room.input,
                label=room.name, caller="phone" if room.phone else "web",
            )  # fmt: skip
            try:
                return await call.wait_open(timeout=max(0.1, join_by - loop.time()))
            except EngineFull as e:
                await call.aclose()
                refusal = e
        if not isinstance(refusal, EngineOverloaded) or loop.time() + wait >= join_by or stop.is_set():
            room.refused = str(refusal)
            print(f"{room.name} refused: {refusal}", flush=True)
            return None
        room.redials += 1
        await asyncio.sleep(wait * (0.5 + random.random()))  # backing off, not in step with the others
        wait = min(2 * wait, REDIAL_MAX_S)


async def run_room(room: Room, engine: Engine, hotel: Hotel, out: Path, start_at: float, join_by: float,
                   today: dt.date, clips: list[np.ndarray], go: asyncio.Event, end: list[float],
                   stop: asyncio.Event, settings: Any) -> None:  # fmt: skip
    """Join (slot, prompt prefill) by `join_by`, then follow the room's script from `go` until `end[0]`."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    rng = random.Random(room.index)
    try:
        handle = await join(room, engine, hotel, out, join_by, stop, settings)
        if handle is None:
            return
        call = room.call
        while not call.duplex.live and not stop.is_set():
            if loop.time() > join_by:
                room.error = "never went live before the join deadline"
                print(f"{room.name} failed: {room.error}", flush=True)
                return
            await asyncio.sleep(0.05)
        room.live_at = loop.time()
        force = Forcing(handle, engine.tokens, call.duplex)
        while (
            not go.is_set() and not stop.is_set()
        ):  # joined: hold the model to silence until the talk starts
            force.top_up()
            await asyncio.sleep(0.1)
        tok = engine.tokens
        script = tool_script(today, room.index, room.phone)
        t0 = loop.time()
        next_utt = t0 + 0.5 + rng.random() * 2
        next_tool = t0 + 2.0 + rng.random() * 3 if room.tool_room else float("inf")
        pending_reply = False
        while not stop.is_set() and loop.time() < end[0]:
            now = loop.time()
            duplex = call.duplex
            if now >= next_utt:
                room.input.push(clips[rng.randrange(len(clips))])
                force.text([tok.bos, *tok.encode(rng.choice(REPLIES)), tok.eos])  # the reply to the caller
                room.scripted_turns += 1
                next_utt = now + UTTERANCE_EVERY_S
            if now >= next_tool and now < end[0] - LAST_CALL_S and not duplex.paused and not pending_reply:
                # each tool room starts at a different step, so short runs still book rooms
                force.call(tok.call_ids([script[(2 * room.index + room.scripted_calls) % len(script)]]))
                room.scripted_calls += 1
                next_tool = now + TOOL_EVERY_S
                pending_reply = True
            if pending_reply and force.call_paused():
                # forced while paused, so the model speaks it as soon as the tool result is consumed
                force.text([tok.bos, *tok.encode(" Thanks for waiting."), tok.eos])
                pending_reply = False
            force.top_up()
            await asyncio.sleep(0.1)
        # the window is over: a call still on its way is seen through (tool, result, replay), within DRAIN_S
        while not stop.is_set() and call.duplex.stats["resumes"] < room.scripted_calls:
            if loop.time() > end[0] + DRAIN_S:
                break
            force.top_up()
            await asyncio.sleep(0.1)
    except Exception as e:  # one room failing is reported, not fatal
        room.error = f"{type(e).__name__}: {e}"
        log.exception("%s failed", room.name)
    finally:
        room.input.end()


def _progress(engine: Engine, rooms: list[Room], phase: str, elapsed: float, total: float) -> str:
    snap = engine.snapshot()
    live = sum(1 for r in rooms if r.live_at is not None)
    refused = sum(1 for r in rooms if r.refused)
    calls = sum(r.call.duplex.stats["function_calls"] for r in rooms if r.call and r.call.duplex)
    return (
        f"[{phase} {elapsed:5.1f}/{total:.0f} s] rooms live {live:3d}/{len(rooms)}"
        + (f" ({refused} refused)" if refused else "")
        + f"  live step p50 {snap.live_ms_p50:5.1f} p99 {snap.live_ms_p99:5.1f} ms  missed {snap.missed_deadlines}"
        f"  tool calls {calls}"
        + (f"  engine refusals {snap.refused_sessions}" if snap.refused_sessions else "")
        + ("  (overloaded)" if snap.overloaded else "")
    )


def _window(engine: Engine, ticks0: int, missed0: int) -> dict:
    """Tick figures of the measured window only (the join phase's prompt prefill excluded)."""
    snap = engine.snapshot()
    n = snap.ticks - ticks0
    live_ms = list(engine.acct.live_ms)[-n:] if n > 0 else []
    pct = (lambda q: round(float(np.percentile(live_ms, q)), 2)) if live_ms else (lambda q: 0.0)
    return {"ticks": n, "live_ms_p50": pct(50), "live_ms_p99": pct(99),
            "live_ms_max": round(max(live_ms), 2) if live_ms else 0.0,
            "missed_deadlines": snap.missed_deadlines - missed0,
            "slow_live_steps": [[i, round(ms, 1)] for i, ms in enumerate(live_ms) if ms > 80.0]}  # fmt: skip


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine, or SimulateError with one line naming what is wrong."""
    from engine.engine import Engine

    if args.checkpoint and not Path(args.checkpoint).exists():
        raise SimulateError(f"--checkpoint {args.checkpoint}: no such file or folder")
    try:
        # every engine setting of the environment (windows, capacity mode, ...), the flags over them
        config = args.settings.engine_config(
            preset=args.preset,
            num_slots=args.slots,
            checkpoint=args.checkpoint,
            tokenizer=args.tokenizer,
            speaker=args.speaker,
            device=args.device,
            metrics_port=args.metrics_port,
        )
        return Engine(config)
    except Exception as e:  # a corrupt checkpoint or a device that is not there: one line, not a traceback
        what = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--preset {args.preset}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SimulateError(f"cannot build the engine ({what}): {first}") from None


async def simulate(args: argparse.Namespace) -> dict:
    from tools.hotel import Hotel
    from tools.seed import seed
    from tools.store import open_store

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = args.store
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = open_store(settings)
    today = dt.date.today()
    seed(store, today)
    hotel = Hotel(store)
    bookings_before = len(hotel.reservations())
    try:
        engine = build_engine(args)
    except SimulateError:
        store.close()
        raise
    if engine.server is not None:  # the monitoring page can watch the run (docs/monitoring.md)
        url = f"http://{engine.config.metrics_host}:{engine.server.port}/snapshot"
        where = "" if settings.database_url else f" CHORUS_DATA_DIR={settings.data_dir}"
        print(
            f"engine snapshot at {url}; watch it with: CHORUS_MONITOR_URLS={url}{where} python -m ui",
            flush=True,
        )

    # SIGTERM stops the run as Ctrl-C does: the figures so far are written
    main_task = asyncio.current_task()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell may start a job with it ignored
            asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)
    phones = phone_rooms(args.rooms, args.phone_rooms)
    rooms = [Room(i, i < args.tool_rooms, i in phones) for i in range(args.rooms)]
    clips = caller_clips()
    phone_clips = [telephone_band(c, 16_000) for c in clips]
    go, stop = asyncio.Event(), asyncio.Event()
    end = [float("inf")]
    loop = asyncio.get_running_loop()
    # callers arrive one every JOIN_EVERY_S, as a phone line fills, not all in the same instant
    ramp = min(JOIN_EVERY_S * len(rooms), MAX_RAMP_S, args.seconds / 4)
    t_start = loop.time()
    join_by = t_start + ramp + args.join_timeout
    tasks = [
        asyncio.create_task(run_room(r, engine, hotel, out, t_start + ramp * i / len(rooms), join_by, today,
                                     phone_clips if r.phone else clips, go, end, stop, args.agent))
        for i, r in enumerate(rooms)
    ]  # fmt: skip
    tty = sys.stdout.isatty()

    def show(line: str) -> None:
        print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)

    ended = "completed"
    join_s = 0.0
    rss: list[list[float]] = []
    heap: list[list[float | None]] = []  # the C heap in use at the same moments (metrics.json "heap_mb")
    snap0 = engine.snapshot()
    window: dict = _window(engine, snap0.ticks, snap0.missed_deadlines)
    try:
        async with asyncio.timeout(ramp + args.join_timeout + args.seconds + GRACE_S):
            # join: every room takes a slot and its prompt is prefilled, or is refused, or fails by join_by
            while not all(r.live_at is not None or r.error or r.refused for r in rooms):
                await asyncio.wait(tasks, timeout=1.0)
                show(_progress(engine, rooms, "join", loop.time() - t_start, ramp + args.join_timeout))
            join_s = loop.time() - t_start
            quiet_gc()
            await asyncio.sleep(0.2)  # the tick that waited for the collection is not the talk's
            snap0 = engine.snapshot()
            t_go = loop.time()
            end[0] = t_go + args.seconds
            go.set()
            next_rss = t_go
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=1.0)
                show(_progress(engine, rooms, "talk", loop.time() - t_go, args.seconds))
                if loop.time() >= next_rss:  # the process's resident memory, once a minute
                    rss.append([round(loop.time() - t_go), rss_mb()])
                    heap.append([round(loop.time() - t_go), heap_mb()])
                    next_rss += RSS_EVERY_S
    except TimeoutError:
        ended = "deadline"
    except asyncio.CancelledError:  # Ctrl-C: stop here and report what ran
        ended = "interrupted"
    finally:
        window = _window(engine, snap0.ticks, snap0.missed_deadlines)
        stop.set()
        go.set()
        if tty:
            print()
        if ended != "completed":
            print(f"simulate: {ended}; stopping the rooms and writing the figures so far", flush=True)
        snap = engine.snapshot()  # before the rooms close: the run's own figures
        # the agents end their calls: what each has queued still plays (interrupted: cut at once)
        closing = [r.call.aclose(play_out=ended == "completed") for r in rooms if r.call is not None]
        await asyncio.gather(*closing, return_exceptions=True)
        for r in rooms:
            if r.call is not None:
                r.frames_in = r.call.handle.frames_in if r.call.handle is not None else 0
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)  # slots are freed on the next tick
        occupancy_after = engine.occupancy
        engine.close()
        bookings = len(hotel.reservations()) - bookings_before
        store.close()
        gc.unfreeze()

    per_room = []
    for r in rooms:
        d = r.call.duplex.stats if r.call and r.call.duplex else {}
        o = r.call.output.stats if r.call else {}
        lost = d.get("frames_pushed", 0) - r.frames_in
        if r.error is None and d.get("input_errors", 0):
            r.error = f"caller audio forwarding failed {d['input_errors']} times"
        if r.error is None and lost > 0 and ended == "completed" and r.live_at is not None:
            r.error = f"{lost} caller frames never reached the engine"
        per_room.append({"room": r.name, "tool_room": r.tool_room, "phone": r.phone,
                         "live": r.live_at is not None, "scripted_turns": r.scripted_turns, "scripted_calls": r.scripted_calls,
                         "function_calls": d.get("function_calls", 0), "tool_results": d.get("tool_results", 0),
                         "resumes": d.get("resumes", 0), "rejected_calls": d.get("rejected_calls", 0),
                         "barge_ins": d.get("barge_ins", 0), "frames_pushed": d.get("frames_pushed", 0),
                         "frames_in": r.frames_in, "input_errors": d.get("input_errors", 0),
                         "speech_s": round(o.get("model_s", 0.0), 2), "clips": o.get("clips", 0),
                         "clip_s": round(o.get("clip_s", 0.0), 2), "redials": r.redials, "error": r.error,
                         "refused": r.refused})  # fmt: skip
    total = {k: sum(p[k] for p in per_room) for k in ("scripted_turns", "scripted_calls", "function_calls",
                                                       "tool_results", "resumes", "rejected_calls", "clips",
                                                       "frames_pushed", "frames_in", "input_errors",
                                                       "redials")}  # fmt: skip
    metrics = {
        "rooms": args.rooms, "tool_rooms": args.tool_rooms, "phone_rooms": args.phone_rooms,
        "seconds": args.seconds, "preset": args.preset, "device": snap.device, "slots": args.slots, "ended": ended, "join_s": round(join_s, 1),
        "rooms_live": sum(1 for p in per_room if p["live"]),
        "rooms_refused": sum(1 for p in per_room if p["refused"]), **window,
        "missed_deadlines_join": snap0.missed_deadlines, "missed_deadlines_total": snap.missed_deadlines,
        "overruns": snap.overruns, "slipped_ticks": snap.slipped_ticks, "dropped_frames": snap.dropped_frames,
        "skipped_frames": snap.skipped_frames, "underruns": snap.underruns, "engine_tool_calls": snap.tool_calls,
        "tool_call_ms_p50": snap.tool_call_ms_p50, "resume_ms_p50": snap.resume_ms_p50, **total,
        "bookings_made": bookings,
        "speech_s": round(sum(p["speech_s"] for p in per_room), 1), "clip_s": round(sum(p["clip_s"] for p in per_room), 1),
        "room_errors": sum(1 for p in per_room if p["error"]), "occupancy_after": occupancy_after,
        "tool_calls_scripted": True, "out": str(out),
    }  # fmt: skip
    slow_live_steps = metrics.pop("slow_live_steps")
    (out / "metrics.json").write_text(
        json.dumps(
            {
                "summary": metrics,
                "slow_live_steps": slow_live_steps,
                "rss_mb": rss,
                "heap_mb": heap,
                "rooms": per_room,
                "engine": snap.model_dump(),
            },
            indent=1,
        )
    )
    return metrics


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
        help="rooms whose callers are on the phone: 8 kHz mu-law audio, the phone concierge (default: a quarter)",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="how long each room's call lasts (default 60)")
    p.add_argument("--preset", help="engine preset (default: CHORUS_PRESET, else tiny)")
    p.add_argument("--checkpoint", help="weights to load (default: CHORUS_CHECKPOINT, else dummy weights)")
    p.add_argument("--tokenizer", help="the thinker's tokenizer.json or folder (default: CHORUS_TOKENIZER)")
    p.add_argument("--speaker", help="speaker latent of the checkpoint (default: CHORUS_SPEAKER, else Aria)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CHORUS_DEVICE, else cuda if any)")
    p.add_argument(
        "--slots", type=int, default=None, help="engine slots (default: one per room, at most 64); rooms "
        "beyond them are refused"
    )  # fmt: skip
    p.add_argument(
        "--join-timeout", type=float, default=60.0, help="seconds a room may take to go live (default 60)"
    )
    p.add_argument("--out", default="out/simulate", help="output folder: one WAV per room and metrics.json")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve the engine's /snapshot and /metrics on "
        "127.0.0.1 during the run, for the monitoring page (0: any free port, printed at the start; default: "
        "CHORUS_METRICS_PORT, else not served)"
    )  # fmt: skip


def check_arguments(args: argparse.Namespace) -> None:
    """Fill the defaults from the settings and the other arguments; SimulateError naming the first bad value.
    Every setting is checked, also those the simulation does not use (CHORUS_SLOTS), as the worker would."""
    from agent.settings import AgentSettings
    from engine.presets import PRESETS
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
    if args.metrics_port is None:
        args.metrics_port = settings.metrics_port
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise SimulateError(f"--metrics-port {args.metrics_port}: give 0 (any free port) to 65535")
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
    args.agent = settings
    if not args.seconds > 0:
        raise SimulateError(f"--seconds {args.seconds:g}: give a positive number")
    if not args.join_timeout > 0:
        raise SimulateError(f"--join-timeout {args.join_timeout:g}: give a positive number")
    if args.slots is None:
        args.slots = min(args.rooms, 64)
    if not 1 <= args.slots <= 4096:
        raise SimulateError(f"--slots {args.slots}: give 1 to 4096")
    if args.preset not in PRESETS:
        raise SimulateError(f"--preset {args.preset}: unknown; choose one of {', '.join(sorted(PRESETS))}")


def main(args: argparse.Namespace) -> int:
    try:
        check_arguments(args)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        # a refused room is reported in one line by `join`; the framework's closing error says it again
        logging.getLogger("livekit.agents").addFilter(
            lambda r: not (r.exc_info and isinstance(r.exc_info[1], EngineFull))
        )
        metrics = asyncio.run(simulate(args))
    except SimulateError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during the wind-down
        print("simulate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print_summary(metrics)
    print(json.dumps(metrics))
    return exit_code(metrics)
