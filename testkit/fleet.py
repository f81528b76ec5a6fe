"""A fleet's faults, as tests/test_livekit_fleet.py and benchmarks/fleet_faults.py make them: two workers of
one agent name on a real LiveKit server with Redis, a caller on one of them, and a fault on the worker that
serves it (its process killed, its engine's process killed, the room's job process killed, or a drain); then
when the caller heard a new agent's voice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

from testkit.callers import Caller
from testkit.machine import cmdline, tree
from testkit.server import Server
from testkit.worker import Worker, sessions_by_label

POLL_S = 0.1


def serving(workers: list[Worker], caller: Caller) -> Worker | None:
    """The worker whose engine holds the caller's session."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            if caller.room_name in sessions_by_label(w.snapshot()):
                return w
    return None


async def heard_again(caller: Caller, first: str, since: float, within: float) -> tuple[str, float]:
    """The new agent whose voice the caller heard after `since` (loop time), and when, after it (waiting at
    most `within` + 60 s: a slower one is reported, for the caller to judge)."""

    def new_voice() -> tuple[str, float] | None:
        for agent, at in caller.heard.speech_at.items():
            if agent != first and at > since:
                return agent, at - since
        return None

    deadline = asyncio.get_running_loop().time() + within + 60
    while (found := new_voice()) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no new agent's voice within {within + 60:.0f} s: {caller.heard.summary()}")
        await asyncio.sleep(POLL_S)
    return found


def two_workers(
    server: Server, store_dir: Path, name: str, slots: int = 2, **env: str
) -> contextlib.ExitStack:
    """Two workers of agent name `name` with `slots` each, registered (`.workers`); stopped when the stack
    closes."""
    stack = contextlib.ExitStack()
    workers = [Worker(server, store_dir, slots=slots, name=name, **env) for _ in range(2)]
    for w in workers:
        stack.callback(w.stop)
        w.launch()
    for w in workers:
        w.start()
    stack.workers = workers
    return stack


def holds_a_session(pid: int) -> bool:
    """A room's process that holds a session on the engine: one that maps a session's shared memory."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("chorus-session" in line for line in f)
    except OSError:
        return False


def kill_worker(w: Worker) -> None:
    w.proc.send_signal(signal.SIGKILL)


def kill_engine(w: Worker) -> None:
    engine = next(p for p in tree(w.proc.pid)[1:] if "engine.door.serve" in cmdline(p))
    os.kill(engine, signal.SIGKILL)


def kill_job(w: Worker) -> None:
    """The room's own process (livekit-agents' process executor, CHORUS_ROOM_PROCESSES=true)."""
    rooms = [p for p in tree(w.proc.pid)[1:] if "engine.door.serve" not in cmdline(p)]
    busy = [p for p in rooms if holds_a_session(p)]
    os.kill(busy[0], signal.SIGKILL)


def drain(w: Worker) -> None:
    w.signal(signal.SIGTERM)


# name -> (the fault, the workers' environment)
FAULTS: dict[str, tuple[Callable[[Worker], None], dict[str, str]]] = {
    "worker SIGKILL": (kill_worker, {}),
    "engine SIGKILL": (kill_engine, {}),
    "job crash": (kill_job, {"CHORUS_ROOM_PROCESSES": "true"}),
    "drain": (drain, {"CHORUS_DRAIN_TIMEOUT_S": "60"}),
}


async def one_fault(
    server: Server, workers: list[Worker], name: str, fault: Callable[[Worker], None]
) -> dict:
    """One call on `workers` (agent name `name`), `fault` on its worker once the caller heard the agent;
    when the caller heard a new agent's voice after it, and what it said."""
    caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
    await caller.join()
    try:
        await asyncio.wait_for(caller.first_speech.wait(), 60)
        first = caller.heard.agent_identity
        # the agent's first turn said whole (its transcript is final once the turn ended), and kept
        deadline = asyncio.get_running_loop().time() + 60
        while not caller.heard.transcripts:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the agent's first turn did not end: {caller.heard.summary()}")
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(0.5)
        deadline = asyncio.get_running_loop().time() + 30
        while (victim := serving(workers, caller)) is None:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("no worker holds the caller's session")
            await asyncio.sleep(POLL_S)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fault(victim)
        agent, after = await heard_again(caller, first, t0, 10.0)
        deadline = loop.time() + 30  # its first turn said whole
        while not any(s == agent for s, _, _ in caller.heard.transcripts) and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(max(0.0, after + 3.0 - (loop.time() - t0)))  # room for a wrongly sent second
        return {
            "after_s": after,
            "agent": agent,
            "first": first,
            "agents": set(caller.heard.agents),
            "speakers": {a for a, at in caller.heard.speech_at.items() if at > t0},
            "victim": workers.index(victim),
            "said": [t for s, t, _ in caller.heard.transcripts if s == agent],
            "connection": list(caller.heard.connection),
            # from the first agent leaving to the new one's voice (a drain's handover: the caller's silence)
            "gap_s": (
                max(0.0, caller.heard.speech_at[agent] - caller.heard.left_at[first])
                if first in caller.heard.left_at
                else None
            ),
        }
    finally:
        await caller.leave()


async def fault_on_calls(
    server: Server,
    workers: list[Worker],
    name: str,
    fault: Callable[[Worker], None],
    calls: int,
    *,
    one_call: bool = False,
) -> list[dict]:
    """`calls` calls on `workers` at once (agent name `name`), `fault` on the worker that serves the most of
    them once every caller heard their agent's first turn; per caller hit by it (its worker's callers, or
    with `one_call` the one whose room's job it ended), when it heard a new agent's voice, and what that
    agent said. Callers on the other worker are reported too, with `hit` False."""
    loop = asyncio.get_running_loop()
    callers = [Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name) for _ in range(calls)]
    try:
        for c in callers:
            await c.join()
        deadline = loop.time() + 90
        while not all(c.first_speech.is_set() and c.heard.transcripts for c in callers):
            if loop.time() > deadline:
                seen = [c.heard.summary() for c in callers]
                raise AssertionError(f"not every agent said its first turn: {seen}")
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(0.5)
        held: dict[int, list[Caller]] = {}
        deadline = loop.time() + 30
        while sum(len(v) for v in held.values()) < calls:
            if loop.time() > deadline:
                raise AssertionError("not every caller's session is held by a worker")
            held = {i: [c for c in callers if serving([w], c) is not None] for i, w in enumerate(workers)}
            await asyncio.sleep(POLL_S)
        victim = max(held, key=lambda i: len(held[i]))
        first = {c: c.heard.agent_identity for c in callers}
        t0 = loop.time()
        fault(workers[victim])
        expected = 1 if one_call else len(held[victim])

        def new_voice(c: Caller) -> tuple[str, float] | None:
            for agent, at in c.heard.speech_at.items():
                if agent != first[c] and at > t0:
                    return agent, at - t0
            return None

        deadline = t0 + 70
        while sum(new_voice(c) is not None for c in callers) < expected and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(3.0)  # room for a wrongly sent second agent

        def first_turn_said(c: Caller) -> bool:  # the new agent's first turn whole (its transcript is final)
            found = new_voice(c)
            return found is None or any(s == found[0] for s, _, _ in c.heard.transcripts)

        deadline = loop.time() + 30
        while not all(first_turn_said(c) for c in callers) and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        out = []
        for c in callers:
            found = new_voice(c)
            agent = found[0] if found else None
            out.append(
                {
                    "hit": found is not None or (not one_call and c in held[victim]),
                    "after_s": found[1] if found else None,
                    "agent": agent,
                    "new_speakers": {a for a, at in c.heard.speech_at.items() if at > t0 and a != first[c]},
                    "said": [t for s, t, _ in c.heard.transcripts if s == agent],
                    "gap_s": (
                        max(0.0, c.heard.speech_at[agent] - c.heard.left_at[first[c]])
                        if agent and first[c] in c.heard.left_at
                        else None
                    ),
                }
            )
        return out
    finally:
        for c in callers:
            await c.leave()
