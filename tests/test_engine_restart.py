"""The worker's engine comes back (agent/fleet/engine_watch.py): its process killed, the worker reports itself
full and turns jobs away at once, starts the engine again at the same address with the same keys (a room's
process made before the death reaches the new one), and reports itself available when it is up; an engine that
dies three times within five minutes makes the worker exit non-zero, for its supervisor. Two workers on one
host start with nothing set to tell their health ports apart. Real engine processes (`tiny`), no LiveKit.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import worker
from agent.fleet import engine_watch
from agent.settings import AgentSettings
from engine.api import EngineClosed
from engine.client.remote import RemoteEngine
from wait_support import await_until

pytestmark = pytest.mark.serial  # the engine's deaths and restarts, timed on the wall clock

ROOT = Path(__file__).resolve().parent.parent


class Offer:
    """A job offered to the worker (livekit-agents' JobRequest, as `on_request` uses it)."""

    def __init__(self, job: str) -> None:
        self.id, self.answer = job, None
        self.room = SimpleNamespace(name=f"room-{job}")

    async def accept(self, **_) -> None:
        self.answer = "accept"

    async def reject(self, **_) -> None:
        self.answer = "reject"


def test_a_killed_engine_is_restarted_and_the_worker_is_full_until_it_is_back(seeded_env, monkeypatch):
    monkeypatch.setattr(engine_watch, "RESTART_FIRST_S", 0.2)
    settings = AgentSettings(slots=2, refuse_when_overloaded=False)
    control = worker.shared_engine(settings)
    watch = worker.engine_watch()
    room = RemoteEngine()  # a room's process made before the death: the address and key it inherited
    first = watch.process.proc.pid
    assert worker.engine_load(settings) == 0.0

    async def main():
        watch.process.proc.send_signal(signal.SIGKILL)
        await await_until(lambda: not watch.up, "the worker to see its engine dead", timeout=5)
        full = worker.engine_load(settings)
        offer = Offer("AJ_during")
        await worker.on_request(offer, settings)
        await await_until(lambda: watch.up, "the engine back", timeout=120)
        back = worker.engine_load(settings)
        later = Offer("AJ_after")
        await worker.on_request(later, settings)
        handle = await asyncio.to_thread(
            room.open_session, "You are a concierge.", loop=asyncio.get_running_loop(), admission="AJ_after"
        )
        return full, offer.answer, back, later.answer, handle

    full, during, back, after, handle = asyncio.run(main())
    assert full == settings.load_target  # full: LiveKit offers this worker no room
    assert during == "reject"
    assert back == 0.0 and after == "accept"
    assert watch.process.proc.pid != first and watch.restarts == 1
    assert not handle.closed and control.status()["occupancy"] == 0.5
    handle.close()


WORKER = textwrap.dedent(
    """
    import sys, time
    from agent import worker
    from agent.fleet import engine_watch
    from agent.settings import AgentSettings
    engine_watch.RESTART_FIRST_S = 0.2
    worker.shared_engine(AgentSettings(slots=1))
    print("up", flush=True)
    while True:
        print(worker.engine_watch().process.proc.pid, worker.engine_watch().up, flush=True)
        time.sleep(0.2)
    """
)


def test_an_engine_that_dies_three_times_in_five_minutes_makes_the_worker_exit_for_its_supervisor(seeded_env):
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        killed: set[int] = set()
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            line = proc.stdout.readline().split()
            if len(line) == 2 and line[1] == "True" and int(line[0]) not in killed:
                killed.add(int(line[0]))
                os.kill(int(line[0]), signal.SIGKILL)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(killed) == engine_watch.GIVE_UP_AFTER
    assert code == engine_watch.ENGINE_FAILING
    for pid in killed:  # no engine left behind
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_door_that_refuses_the_worker_is_an_engine_down(seeded_env):
    """The worker's questions to an engine that is not there: EngineClosed, and a load of 1.0."""
    control = worker.shared_engine(AgentSettings(slots=1))
    watch = worker.engine_watch()
    watch.stop()
    with pytest.raises(EngineClosed):
        control.status()
    assert control.load == 1.0 and watch.load == 1.0


def test_two_workers_on_one_host_start_with_nothing_set_to_tell_their_health_ports_apart(
    seeded_env, tmp_path
):
    env = {
        **os.environ,
        "CHORUS_SLOTS": "1",
        "LIVEKIT_URL": "ws://127.0.0.1:9",  # no server: each worker keeps trying, its health endpoint up
        "LIVEKIT_API_KEY": "devkey",
        "LIVEKIT_API_SECRET": "s" * 40,
    }
    env.pop("CHORUS_HTTP_PORT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "agent", "start"],
            cwd=ROOT,
            env=env,
            stdout=(tmp_path / f"worker{i}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        ports: list[int] = []
        for i, proc in enumerate(procs):
            log = tmp_path / f"worker{i}.log"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                m = re.search(r"health and /worker on port (\d+)", log.read_text(errors="replace"))
                if m:
                    ports.append(int(m.group(1)))
                    break
                time.sleep(0.2)
            assert ports[i:], f"worker {i} never started: {log.read_text(errors='replace')[-2000:]}"
        # both listen: a supervisor finds each one's health endpoint
        for port in ports:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"nothing listens on {port}"
                    time.sleep(0.2)
        # and both go on past their start: each has tried LiveKit, failed and keeps trying
        for i, proc in enumerate(procs):
            log = tmp_path / f"worker{i}.log"
            deadline = time.monotonic() + 60
            while "failed to connect to livekit, retrying" not in (text := log.read_text(errors="replace")):
                assert proc.poll() is None and time.monotonic() < deadline, text[-2000:]
                time.sleep(0.1)
        assert [p.poll() for p in procs] == [None, None], [
            (tmp_path / f"worker{i}.log").read_text(errors="replace")[-2000:] for i in range(2)
        ]
        assert len(set(ports)) == 2 and all(p in worker.HEALTH_PORTS for p in ports)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
