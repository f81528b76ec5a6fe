"""The soak's calls (benchmarks/soak.py): their plan (Poisson arrivals, lengths, kinds, drops), the rooms sold
out before the run, and running one call as its caller lives it, recorded for the checks: when the agent's
voice was heard, which agents, the caller's own outage, what the scripted tool calls were to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.call import room_label
from testkit.callers import RATE, Caller, caller_pcm
from testkit.lone_caller import audible_times, said_by
from testkit.server import ROOT, Server
from testkit.sip import PhoneCaller, inbound

ANSWER_S = 30.0  # a call whose caller heard no agent this long after joining is refused
TAKEN = {"room_type": "family suite", "days_ahead": 20, "nights": 2, "rooms": 4}  # sold out before the run
PHONE, BOOKING, DROP = 0.25, 0.25, 0.05  # shares of the calls; DROP of the web callers
SAID_AFTER = {  # the line the script says once a tool's result is in: heard, the tool ran
    "booking": " Your room is booked.",
    "cancel": " Your reservation is cancelled.",
    "taken": " Let me see what else we have.",
}
FIRST = ("booking", "phone", "web", "taken", "booking", "cancel")  # the first calls' (the web one drops)
SURNAMES = ("Alder", "Birch", "Cedar", "Dunmore", "Ellery", "Fairley", "Garrow", "Hadley", "Ingram", "Jessop")


@dataclass
class CallPlan:
    i: int
    start_s: float  # after the run's start
    length_s: float
    kind: str  # web, phone, booking, cancel, taken
    drop_at_s: float | None = None  # a web caller's network lost this far into the call...
    drop_s: float = 0.0  # ...this long
    tool_at_s: float = 4.0  # a scripted tool call, this far after the agent's greeting


@dataclass
class CallRecord:
    plan: CallPlan
    room: str = ""
    label: str = ""
    joined_at: float | None = None
    answered_at: float | None = None  # the agent's first audible frame
    left_at: float | None = None
    audible: list[float] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    first_agent: str = ""  # the room's first agent (heard or not)
    outages: list[tuple[float, float]] = field(default_factory=list)  # the caller's own network loss
    hit_at: float | None = None  # a fault on the worker serving it (the first, if two were)
    hit_by: str = ""  # which
    hit_again_at: float | None = None  # a later fault on the worker of its new agent: judged up to here
    speech_at: dict[str, float] = field(default_factory=dict)  # each agent's first words heard
    agent_left_at: dict[str, float] = field(default_factory=dict)  # when each agent that left did
    said: dict[str, str] = field(default_factory=dict)  # each agent's words (its turns' transcripts)
    turns_at: list[tuple[str, float]] = field(default_factory=list)  # (agent, when) each turn's words came
    guest: str = ""  # a booking's (or a cancelled booking's) guest name
    code: str = ""  # a cancel's confirmation code
    reached: bool = False  # the tool's result was in (its line heard)
    mid_turn: bool = False  # hung up while the agent spoke
    error: str = ""

    def longest_unasked(self, asked_s: float) -> float:
        """The longest silence the caller lived through after the agent's first words and up to the hang-up,
        their own outages left out, less `asked_s` (the script's own pause between turns)."""
        if self.answered_at is None or self.left_at is None:
            return 0.0
        t = np.asarray([self.answered_at, *[a for a in self.audible if a > self.answered_at], self.left_at])
        gaps = [
            (a, b)
            for a, b in zip(t[:-1], t[1:], strict=True)
            if not any(a < end and b > start for start, end in self.outages)
        ]
        longest = max((b - a for a, b in gaps), default=0.0)
        return max(0.0, float(longest) - asked_s)


def plan_calls(
    rng: random.Random, seconds: float, live: float, length: tuple[float, float]
) -> list[CallPlan]:
    """Poisson arrivals giving `live` calls at once on average (Little's law), each ending by `seconds`."""
    rate = live / ((length[0] + length[1]) / 2)
    out, t = [], rng.expovariate(rate) * 0.2  # the first calls come soon
    while t < seconds - length[0]:
        u = rng.random()
        kind = "phone" if u < PHONE else "web"
        if PHONE <= u < PHONE + BOOKING:
            kind = rng.choices(["booking", "cancel", "taken"], [0.6, 0.2, 0.2])[0]
        if len(out) < len(FIRST):  # a short run has every kind too
            kind = FIRST[len(out)]
        plan = CallPlan(
            len(out), t, min(rng.uniform(*length), seconds - t), kind, tool_at_s=rng.uniform(2, 8)
        )
        # web is half the calls: 5% of all are dropped
        if kind == "web" and (rng.random() < DROP * 2 or len(out) == FIRST.index("web")):
            plan.drop_at_s, plan.drop_s = rng.uniform(0.25, 0.6) * plan.length_s, rng.uniform(5, 15)
        out.append(plan)
        t += rng.expovariate(rate)
    return out


def sell_out(store_dir: Path) -> dict:
    """Book every room of TAKEN's type for its stay (residents' bookings), so a call asking for it is told no;
    the stay's arguments."""
    from tools.hotel import Hotel
    from tools.store import open_store

    check_in = dt.date.today() + dt.timedelta(days=TAKEN["days_ahead"])
    stay = {
        "check_in": check_in.isoformat(),
        "nights": TAKEN["nights"],
        "guests": 2,
        "room_type": TAKEN["room_type"],
    }
    with open_store() as store:
        hotel = Hotel(store)
        for i in range(TAKEN["rooms"]):
            hotel.book_room({"guest_name": f"Resident {SURNAMES[i]}", "contact": "+15550100123", **stay})
    return stay


class CallRunner:
    """Runs the planned calls against agent `agent_name`, keeping a record of each."""

    def __init__(self, server: Server, bridge, agent_name: str, trunk: str, taken: dict, rng, tmp: Path):
        self.server, self.bridge, self.agent_name, self.trunk = server, bridge, agent_name, trunk
        self.taken, self.rng, self.tmp = taken, rng, tmp
        self.records: list[CallRecord] = []
        self.booked: list[CallRecord] = []  # booking calls whose booking a later call may cancel
        self.callers: dict[int, Caller] = {}  # the calls on the line in this process, by their plan's number
        self.t0 = 0.0

    def progress(self) -> tuple[int, int, int, int]:
        """(calls started, answered, ended, frames heard by the callers on the line): what the soak's watchdog
        (testkit/watchdog.py) sees move. Read from its thread, beside the calls': it only reads. (A caller in
        a process of its own, a dropped network's, is seen as it starts and as it ends.)"""
        records, callers = list(self.records), list(self.callers.values())
        return (
            len(records),
            sum(r.answered_at is not None for r in records),
            sum(r.left_at is not None for r in records),
            sum(len(c.heard.times) for c in callers),
        )

    def live_rooms(self) -> dict[str, float | None]:
        """Room label -> when its caller left (None: still on), for the calls that joined."""
        return {r.label: r.left_at for r in self.records if r.label and r.joined_at is not None}

    def hit(self, labels: set[str], at: float, kind: str) -> None:
        for r in self.records:
            if r.label in labels and r.left_at is None:
                if r.hit_at is None:
                    r.hit_at, r.hit_by = at, kind
                elif r.hit_again_at is None:
                    r.hit_again_at = at

    def _script(self, rec: CallRecord) -> str:
        p = rec.plan
        if p.kind == "cancel":
            target = next((b for b in self.booked if b.reached and not b.code), None)
            if target is None:
                p.kind = "booking"  # nothing to cancel yet
            else:
                rec.code = target.code = _code_of(target.guest)
                rec.guest = target.guest
                if not rec.code:
                    p.kind = "booking"
        if p.kind == "cancel":
            name, args = (
                "change_or_cancel_reservation",
                {
                    "confirmation_code": rec.code,
                    "last_name": rec.guest.split()[-1],
                    "action": "cancel",
                    "accept_fee": True,
                },
            )
        elif p.kind == "taken":
            rec.guest = f"Guest {self.rng.choice(SURNAMES)} {_letters(self.rng)}"
            name, args = "book_room", {"guest_name": rec.guest, "contact": "guest@example.com", **self.taken}
        else:
            rec.guest = f"Guest {self.rng.choice(SURNAMES)} {_letters(self.rng)}"
            check_in = dt.date.today() + dt.timedelta(days=self.rng.randrange(25, 200))
            name, args = (
                "book_room",
                {
                    "guest_name": rec.guest,
                    "contact": "guest@example.com",
                    "check_in": check_in.isoformat(),
                    "nights": self.rng.randrange(1, 4),
                    "guests": 2,
                    "room_type": "standard",
                },
            )
            self.booked.append(rec)
        call = {"at_s": p.tool_at_s, "name": name, "arguments": args, "then": SAID_AFTER[p.kind]}
        return json.dumps({"script": {"calls": [call]}})

    async def run(self, plan: CallPlan) -> None:
        rec = CallRecord(plan)
        self.records.append(rec)
        until = self.t0 + plan.start_s + plan.length_s
        try:
            if plan.kind == "phone":
                await self._phone(rec, until)
            elif plan.drop_at_s is not None:
                await self._lone(rec, until)
            else:
                await self._web(rec, until)
        except Exception as e:  # noqa: BLE001 (the call's failure is its record's, reported; the run goes on)
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if rec.left_at is None:
                rec.left_at = time.monotonic()
            if rec.audible:
                rec.mid_turn = rec.left_at - rec.audible[-1] < 0.3

    async def _talk(self, rec: CallRecord, caller: Caller, until: float) -> None:
        rec.joined_at = time.monotonic()
        rec.label = room_label(caller.room_name)
        self.callers[rec.plan.i] = caller
        speech = caller_pcm()
        loop = np.concatenate([speech, np.zeros(8 * RATE, np.int16)])  # a few words every 11.5 s
        talking = asyncio.ensure_future(
            caller.speak(np.resize(loop, int(max(1.0, until - time.monotonic()) * RATE)))
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(caller.first_speech.wait(), ANSWER_S)
            rec.answered_at = min(caller.heard.speech_at.values())
        try:
            while time.monotonic() < until:
                await asyncio.sleep(0.2)
        finally:
            self.callers.pop(rec.plan.i, None)
            talking.cancel()
            await asyncio.gather(talking, return_exceptions=True)
            rec.left_at = time.monotonic()
            await caller.leave()
            rec.audible = audible_times(caller)
            caller.heard.frames.clear()
            rec.agents, rec.first_agent = sorted(caller.heard.agents), caller.heard.agent_identity or ""
            rec.speech_at, rec.agent_left_at = dict(caller.heard.speech_at), dict(caller.heard.left_at)
            rec.said, rec.turns_at = said_by(caller), list(caller.heard.turns_at)
            rec.answered_at = rec.audible[0] if rec.audible else None
            said = " ".join(t for _, t, _ in caller.heard.transcripts).lower()
            rec.reached = rec.plan.kind in SAID_AFTER and SAID_AFTER[rec.plan.kind].strip().lower() in said

    async def _web(self, rec: CallRecord, until: float) -> None:
        meta = self._script(rec) if rec.plan.kind in SAID_AFTER else ""
        rec.room = f"soak-{rec.plan.i:04d}-{uuid.uuid4().hex[:6]}"
        caller = Caller(self.server, rec.room, self.agent_name, f"guest-{uuid.uuid4().hex[:6]}", meta)
        await caller.join()
        await self._talk(rec, caller, until)

    async def _phone(self, rec: CallRecord, until: float) -> None:
        number = f"+1202555{rec.plan.i % 10_000:04d}"  # fictional: 555 numbers
        out = await asyncio.to_thread(inbound, self.server, self.bridge, "--from", number, "--to", self.trunk)
        if out.returncode != 0:
            raise RuntimeError(f"the call was not placed: {out.stdout.strip()[-200:]}")
        call = json.loads(out.stdout)
        caller = PhoneCaller(self.server, call)
        rec.room = call["room"]
        await caller.join()
        await self._talk(rec, caller, until)

    async def _lone(self, rec: CallRecord, until: float) -> None:
        """A web caller in its own process, whose network is lost for `drop_s` (SIGSTOP, then SIGCONT)."""
        p = rec.plan
        rec.room = f"soak-{p.i:04d}-{uuid.uuid4().hex[:6]}"
        spec, out = self.tmp / f"call-{p.i}.json", self.tmp / f"call-{p.i}.out.json"
        spec.write_text(
            json.dumps(
                {
                    "url": self.server.url,
                    "key": self.server.key,
                    "secret": self.server.secret,
                    "room": rec.room,
                    "agent_name": self.agent_name,
                    "identity": f"guest-{uuid.uuid4().hex[:6]}",
                    "until": until,
                }
            )
        )
        log = open(self.tmp / f"call-{p.i}.log", "wb")  # noqa: SIM115 (closed once the process ended)
        proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.lone_caller", str(spec), str(out)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        rec.joined_at = time.monotonic()
        rec.label = room_label(rec.room)
        try:
            await asyncio.sleep(max(0.0, self.t0 + p.start_s + p.drop_at_s - time.monotonic()))
            if proc.poll() is None:
                stopped = time.monotonic()
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.sleep(p.drop_s)
                os.kill(proc.pid, signal.SIGCONT)
                rec.outages.append((stopped, time.monotonic()))
            while proc.poll() is None and time.monotonic() < until + 30:
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
            log.close()
        got = json.loads(out.read_text())
        rec.left_at, rec.audible, rec.agents = got["left_at"], got["audible"], got["agents"]
        rec.first_agent = got["first_agent"] or ""
        rec.speech_at, rec.agent_left_at, rec.said = got["speech_at"], got["agent_left_at"], got["said"]
        rec.turns_at = [(a, t) for a, t in got["turns_at"]]
        rec.answered_at = rec.audible[0] if rec.audible else None
        back = [
            t for s, t in got["connection"] if s == "reconnected" and rec.outages and t > rec.outages[0][0]
        ]
        if back and rec.outages:  # out until the SDK had the connection back
            rec.outages[0] = (rec.outages[0][0], max(rec.outages[0][1], back[0]))


def _letters(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)).capitalize()


@contextlib.contextmanager
def read_only(path: Path):
    """A read-only connection to the soak's SQLite hotel, while the workers write it."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        yield db


def _code_of(guest: str) -> str:
    """The confirmation code of `guest`'s confirmed booking ("" if none), read from the database."""
    from tools.settings import StoreSettings

    with read_only(StoreSettings.from_env().sqlite_path) as db:
        row = db.execute(
            "SELECT code FROM reservations WHERE guest_name = ? AND status = 'confirmed'", (guest,)
        ).fetchone()
    return row[0] if row else ""
