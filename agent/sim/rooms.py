"""The simulation's workload: its virtual rooms, their callers and what each room's agent is scripted to do.

A room joins the engine as LiveKit's dispatcher would send a caller (waiting while the engine has no
headroom), then plays caller utterances in real time while its model is teacher-forced to reply and, in a tool
room, to call the hotel's tools. Knows calls, forcing and the engine's admission answers; nothing of the run's
phases, its deadlines beyond a room's own, or its report (agent/sim/run.py, agent/sim/report.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.audio_out.sinks import WavSink
from agent.call import Call, PcmInput, read_wav, start_call
from agent.forcing import AFTER_TOOL, REPLIES, Forcing
from agent.phone.telephony import PHONE_RATE
from engine.api import EngineFull, EngineOverloaded
from prompts import PROMPTS_DIR

if TYPE_CHECKING:
    from agent.sim.engine_process import SimEngine
    from engine.config.stage_config import ClockConfig
    from tools.hotel import Hotel

log = logging.getLogger("chorus.agent.simulate")

CALLER_WAVS = sorted((PROMPTS_DIR / "callers").glob("caller_*.wav"))
UTTERANCE_EVERY_S = 6.0
TOOL_EVERY_S = 12.0
LAST_CALL_S = 4.0  # no scripted call starts this close to the end of the window
DRAIN_S = 20.0  # after the window, calls still on their way get this long to be answered and resumed
REDIAL_S = 1.0  # a room held back for lack of headroom tries again after this, then
REDIAL_MAX_S = 8.0  # after twice as long each time, up to this
POLL_S = 0.1  # a room's script looks at its call this often
SURNAMES = [
    "Alder",
    "Birch",
    "Cedar",
    "Dogwood",
    "Elm",
    "Fir",
    "Gum",
    "Hazel",
    "Ivy",
    "Juniper",
    "Kauri",
    "Larch",
    "Maple",
    "Nutmeg",
    "Oak",
    "Pine",
]


def tool_script(today: dt.date, room: int, phone: bool = False) -> list[dict]:
    """The calls a tool room makes in turn: real tools, real arguments, run against the database. A phone
    room's are the phone concierge's: the booking's contact left to the caller's number, the lookup through
    `manage_reservation`."""
    check_in = today + dt.timedelta(days=7 + room % 20)
    out = check_in + dt.timedelta(days=2)
    dates = {"check_in": check_in.isoformat(), "check_out": out.isoformat()}
    booking = {"guest_name": f"Sim {SURNAMES[room % len(SURNAMES)]}", "contact": f"sim{room}@example.com"}
    booking |= {**dates, "guests": 2, "room_type": "standard"}
    lookup = {"confirmation_code": "ZZZZ2222", "last_name": "Nobody"}
    if phone:
        del booking["contact"]
    find = (
        {"name": "manage_reservation", "arguments": {**lookup, "action": "find"}}
        if phone
        else {"name": "find_reservation", "arguments": lookup}
    )
    return [
        {"name": "check_availability", "arguments": {**dates, "guests": 2}},
        {"name": "hotel_info", "arguments": {"topic": "parking"}},
        {"name": "book_room", "arguments": booking},
        find,
    ]


def phone_rooms(rooms: int, phones: int) -> set[int]:
    """Which rooms are phone callers: every fourth from the second (so the tool rooms, the first ones, have
    some), then the rest in order, `phones` in all."""
    order = [*range(1, rooms, 4), *(i for i in range(rooms) if i % 4 != 1)]
    return set(order[:phones])


def caller_clips(rate: int) -> list[np.ndarray]:
    """Caller utterances at `rate` (the engine's input rate): the committed test WAVs of that rate, or
    band-limited noise bursts if there are none."""
    clips = []
    for path in CALLER_WAVS:
        pcm, wav_rate = read_wav(path)
        if wav_rate == rate:
            clips.append(pcm)
    if not clips:
        rng = np.random.default_rng(0)
        for n in (2.0, 2.5, 3.0):
            noise = np.convolve(rng.standard_normal(int(rate * n)), np.ones(8) / 8, mode="same")
            clips.append((noise * 6000).astype(np.int16))
    return clips


class Room:
    """One virtual room: its caller's input, its call once joined, and what its script did."""

    def __init__(self, index: int, tool_room: bool, phone: bool, clock: ClockConfig) -> None:
        self.index = index
        self.tool_room = tool_room
        self.phone = phone  # a phone caller: 8 kHz mu-law audio, the phone concierge
        self.call: Call | None = None
        self.input = PcmInput(clock, PHONE_RATE if phone else None)
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

    def figures(self, ended: str) -> dict:
        """The room's line of metrics.json; a room whose caller audio went astray is marked failed here."""
        d = self.call.duplex.stats if self.call and self.call.duplex else {}
        o = self.call.output.stats if self.call else {}
        lost = d.get("frames_pushed", 0) - self.frames_in
        if self.error is None and d.get("input_errors", 0):
            self.error = f"caller audio forwarding failed {d['input_errors']} times"
        if self.error is None and lost > 0 and ended == "completed" and self.live_at is not None:
            self.error = f"{lost} caller frames never reached the engine"
        calls = ("function_calls", "tool_results", "resumes", "rejected_calls", "barge_ins", "frames_pushed")
        return {
            "room": self.name,
            "tool_room": self.tool_room,
            "phone": self.phone,
            "live": self.live_at is not None,
            "scripted_turns": self.scripted_turns,
            "scripted_calls": self.scripted_calls,
            **{k: d.get(k, 0) for k in calls},
            "frames_in": self.frames_in,
            "input_errors": d.get("input_errors", 0),
            "speech_s": round(o.get("model_s", 0.0), 2),
            "clips": o.get("clips", 0),
            "clip_s": round(o.get("clip_s", 0.0), 2),
            "redials": self.redials,
            "error": self.error,
            "refused": self.refused,
        }


@dataclass
class Stage:
    """What every room shares: the engine, the hotel, where the WAVs go, the agent's settings, and the run's
    clock (`join_by` on the loop's clock; `go` starts the talk, `end[0]` ends it, `stop` ends everything).
    The rooms reach the engine as a worker's rooms do, through its door (`engine.remote`: the door's socket
    and shared memory); the join decisions read the engine's load, as the worker's load function does."""

    engine: SimEngine
    hotel: Hotel
    out: Path
    settings: Any
    today: dt.date
    join_by: float
    go: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    end: list[float] = field(default_factory=lambda: [float("inf")])


def _agent(room: Room, stage: Stage) -> Any:
    from agent.hotel import HotelAgent
    from agent.phone.phone import PhoneConcierge, PhoneLine

    key = f"sim-{room.name}-{time.time_ns()}"
    if room.phone:
        line = PhoneLine(stage.settings, room=room.name, identity=f"sip_{room.name}", number=room.number)
        return PhoneConcierge(stage.hotel, line, session_key=key)
    return HotelAgent(stage.hotel, session_key=key)


async def join(room: Room, stage: Stage) -> Any:
    """The room's call on an open engine slot, or None with `room.refused` set. As LiveKit's dispatcher does
    with a worker whose load is full, a room waits (backing off) while the engine reports no headroom, until
    `join_by`; a room that finds every slot taken is refused at once (there is no other worker here)."""
    loop = asyncio.get_running_loop()
    engine = stage.engine
    wait = REDIAL_S
    while True:
        refusal: Exception | None = None
        load = await engine.load()
        if load["occupancy"] >= 1.0:  # no other worker to send the room to
            refusal = EngineFull(f"all {load['num_slots']} slots are in use")
        elif load["load"] >= 1.0:  # the engine turns callers away for lack of headroom
            refusal = EngineOverloaded("the engine reported no headroom until the join deadline")
        else:
            sink = WavSink(stage.out / f"{room.name}.wav", engine.clock.output_rate)
            caller = "phone" if room.phone else "web"
            room.call = call = await start_call(
                engine.remote,
                _agent(room, stage),
                sink=sink,
                audio_input=room.input,
                label=room.name,
                caller=caller,
            )
            try:
                return await call.wait_open(timeout=max(0.1, stage.join_by - loop.time()))
            except EngineFull as e:
                await call.aclose()
                refusal = e
        if (
            not isinstance(refusal, EngineOverloaded)
            or loop.time() + wait >= stage.join_by
            or stage.stop.is_set()
        ):
            room.refused = str(refusal)
            print(f"{room.name} refused: {refusal}", flush=True)
            return None
        room.redials += 1
        await asyncio.sleep(wait * (0.5 + random.random()))  # backing off, not in step with the others
        wait = min(2 * wait, REDIAL_MAX_S)


async def _go_live(room: Room, stage: Stage) -> bool:
    """Until the room's session is live (True), or it fails by the join deadline (False, `room.error` set)."""
    loop = asyncio.get_running_loop()
    while not room.call.duplex.live and not stage.stop.is_set():
        if loop.time() > stage.join_by:
            room.error = "never went live before the join deadline"
            print(f"{room.name} failed: {room.error}", flush=True)
            return False
        await asyncio.sleep(0.05)
    room.live_at = loop.time()
    return True


async def _talk(room: Room, stage: Stage, force: Forcing, clips: list[np.ndarray]) -> None:
    """The room's script from `go` until the end of the window: utterances answered by scripted replies, and
    in a tool room scripted tool calls, each followed by a scripted thanks once it has paused the model."""
    loop = asyncio.get_running_loop()
    rng = random.Random(room.index)
    tok = stage.engine.remote.tokens
    script = tool_script(stage.today, room.index, room.phone)
    t0 = loop.time()
    next_utt = t0 + 0.5 + rng.random() * 2
    next_tool = t0 + 2.0 + rng.random() * 3 if room.tool_room else float("inf")
    pending_reply = False
    while not stage.stop.is_set() and loop.time() < stage.end[0]:
        now, duplex = loop.time(), room.call.duplex
        if now >= next_utt:
            room.input.push(clips[rng.randrange(len(clips))])
            force.text([tok.bos, *tok.encode(rng.choice(REPLIES)), tok.eos])  # the reply to the caller
            room.scripted_turns += 1
            next_utt = now + UTTERANCE_EVERY_S
        if now >= next_tool and now < stage.end[0] - LAST_CALL_S and not duplex.paused and not pending_reply:
            # each tool room starts at a different step, so short runs still book rooms
            force.call(tok.call_ids([script[(2 * room.index + room.scripted_calls) % len(script)]]))
            room.scripted_calls += 1
            next_tool = now + TOOL_EVERY_S
            pending_reply = True
        if pending_reply and force.call_paused():
            # forced while paused, so the model speaks it as soon as the tool result is consumed
            force.text([tok.bos, *tok.encode(AFTER_TOOL), tok.eos])
            pending_reply = False
        await asyncio.sleep(POLL_S)


async def _hold(until: Any) -> None:
    """Until `until()` holds; meanwhile the model stays silent (`Forcing` pads both channels)."""
    while not until():
        await asyncio.sleep(POLL_S)


async def run_room(room: Room, stage: Stage, start_at: float, clips: list[np.ndarray]) -> None:
    """Join (slot, prompt prefill) by `join_by`, then follow the room's script from `go` until `end[0]`; a
    call still on its way when the window ends is seen through (tool, result, replay) within DRAIN_S."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    stop = stage.stop
    try:
        handle = await join(room, stage)
        if handle is None or not await _go_live(room, stage):
            return
        force = Forcing(handle, stage.engine.remote.tokens, room.call.duplex)
        await _hold(lambda: stage.go.is_set() or stop.is_set())  # joined: silence until the talk
        await _talk(room, stage, force, clips)
        duplex = room.call.duplex
        await _hold(
            lambda: (
                stop.is_set()
                or duplex.stats["resumes"] >= room.scripted_calls
                or loop.time() > stage.end[0] + DRAIN_S
            ),
        )
    except Exception as e:  # one room failing is reported, not fatal
        room.error = f"{type(e).__name__}: {e}"
        log.exception("%s failed", room.name)
    finally:
        room.input.end()
