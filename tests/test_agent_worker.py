"""The worker under livekit-agents' offline harness (no LiveKit server): jobs run as threads of this process
(the thread executor) on one shared engine, reached through its socket and shared memory, and the worker's
load is the engine's occupancy, so four calls fill a four-slot worker.
Also the join token and the simulation, the README's main command (`make run`), on a short run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from agent import room, worker
from agent.settings import AgentSettings
from testkit.server import run_python_module
from wait_support import await_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 90.0


def test_four_calls_fill_a_four_slot_worker_and_one_ending_frees_it(seeded_env, monkeypatch, caplog):
    # the slots alone decide here: on a busy shared machine the engine may also report no headroom. The jobs
    # are threads here (the harness's fake jobs, watched from this process); they still reach the engine
    # through its door (engine/door/host.py), as rooms in their own processes do
    settings = AgentSettings(slots=4, http_port=0, refuse_when_overloaded=False, room_processes=False)
    jobs = []  # the jobs' contexts, as the worker's entrypoint gets them, and the loops they run on
    real_run_job = room.run_job

    async def run_job(ctx, job_settings):
        jobs.append((ctx, asyncio.get_running_loop()))
        await real_run_job(ctx, job_settings)

    monkeypatch.setattr(room, "run_job", run_job)

    async def available(server) -> bool:
        """What the worker tells LiveKit: its load (the engine's) under the threshold it was built with."""
        return await asyncio.to_thread(server.load_fnc) < settings.load_target

    async def main():
        server = worker.build_server(settings)
        started = asyncio.Event()
        server.on("worker_started", started.set)
        run = asyncio.create_task(server.run(devmode=True, unregistered=True))
        await await_until(started.is_set, "the worker to start")
        engine = worker.shared_engine(settings)  # the worker's end of its engine's process

        def occupancy() -> float:
            return engine.status()["occupancy"]

        seen = []
        for i in range(4):
            await server.simulate_job(f"room-{i}", fake_job=True)
        await await_until(lambda: occupancy() == 1.0, "four calls on the engine")
        seen.append((len(server.active_jobs), occupancy(), await available(server)))
        ctx, loop = jobs[0]
        loop.call_soon_threadsafe(ctx.shutdown, "the caller left")  # one caller's job ends
        await await_until(lambda: occupancy() == 0.75, "the slot to be freed")
        await await_until(lambda: len(server.active_jobs) == 3, "the job to end")
        seen.append((len(server.active_jobs), occupancy(), await available(server)))
        await server.aclose()
        await await_until(lambda: occupancy() == 0.0, "every slot to be freed")
        await asyncio.wait_for(run, TIMEOUT_S)
        return seen

    caplog.set_level(logging.INFO)
    full, freed = asyncio.run(main())
    print("full", full, "after one ended", freed)
    assert full == (4, 1.0, False)  # four jobs, every slot taken: the worker tells LiveKit it is full
    assert freed == (3, 0.75, True)
    # the job told to shut down ended its call itself, at once (livekit-agents would wait 15 s for it)
    ended = [r.getMessage() for r in caplog.records if "call ended" in r.getMessage()]
    assert any("call ended, the job was shut down (the caller left)" in m for m in ended), ended


def test_shared_engine_is_built_once_across_threads(seeded_env):
    import threading

    settings = AgentSettings(slots=2)
    got = []
    threads = [threading.Thread(target=lambda: got.append(worker.shared_engine(settings))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(e is got[0] for e in got)
    assert worker.engine_load(settings) == 0.0


FRAMEWORK_MODELS_MB = 64  # livekit-agents' voice-activity and end-of-turn models take about 250 MB


def test_the_worker_keeps_the_frameworks_own_models_out_of_its_memory():
    """livekit-agents' warm-up, which each job runner imports (with rooms as threads, in the worker's own
    process), loads the framework's voice-activity and end-of-turn models for the agents that use them. A
    Chorus call never does: the worker built, the warm-up loads neither, and the process stays about 250 MB
    smaller. In a fresh interpreter, so that nothing of this one's counts."""
    code = (
        "from agent import worker\n"
        "from agent.settings import AgentSettings\n"
        "worker.build_server(AgentSettings(http_port=0))\n"
        "def rss(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024\n"
        "before = rss()\n"
        "import livekit.agents.ipc._preload as warm_up  # as a job runner imports it\n"
        "print(warm_up._local_inference_models(), rss() - before)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != worker.PRELOAD_LOCAL_INFERENCE}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    loaded, grew_mb = out.stdout.split()[-2:]
    assert loaded == "False" and int(grew_mb) < FRAMEWORK_MODELS_MB, out.stdout


def test_token_carries_the_room_and_the_agent_dispatch():
    from livekit import api

    env = {
        **os.environ,
        "LIVEKIT_API_KEY": "devkey",
        "LIVEKIT_API_SECRET": "s" * 40,
        "CHORUS_AGENT_NAME": "desk",
    }
    out = run_python_module("agent", "token", "--room", "lobby", cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    claims = api.TokenVerifier("devkey", "s" * 40).verify(out.stdout.strip())
    assert claims.video.room == "lobby" and claims.video.room_join
    assert [a.agent_name for a in claims.room_config.agents] == ["desk"]


def test_simulate_runs_rooms_and_ends_with_one_json_line(tmp_path):
    """The README's main command, short: 4 rooms (2 with scripted tool calls, 1 on the phone) for 10 s on a
    fresh data dir.
    The calls are forced (teacher forcing); what they did is read back from the database."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CHORUS_DATA_DIR")}
    out = tmp_path / "sim"
    args = ["--rooms", "4", "--tool-rooms", "2", "--seconds", "10", "--out", str(out)]
    proc = run_python_module("agent", "simulate", *args, cwd=ROOT, env=env, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["rooms"] == last["rooms_live"] == 4 and last["tool_rooms"] == 2 and last["room_errors"] == 0
    assert last["frames_pushed"] == last["frames_in"] > 4 * 100  # every caller frame reached the engine
    assert last["tool_results"] == last["function_calls"] == last["resumes"] >= 2
    assert last["occupancy_after"] == 0.0
    assert "missed deadlines" in proc.stdout  # the summary table came before the JSON line
    wavs = sorted(out.glob("room_*.wav"))
    assert len(wavs) == 4
    for path in wavs:
        with wave.open(str(path), "rb") as w:
            assert w.getframerate() == 22_050 and w.getnframes() / 22_050 >= 10.0
    assert json.loads((out / "metrics.json").read_text())["summary"] == last
    # room 1's script starts with book_room: the real tool booked it
    from tools.hotel import Hotel
    from tools.settings import StoreSettings
    from tools.store import open_store

    with open_store(StoreSettings(data_dir=out / "data")) as store:
        booked = Hotel(store).reservations()
    assert last["bookings_made"] == len(booked) >= 1
    assert {r.guest_name for r in booked} == {"Sim Birch"}
    # room 1 is the run's phone room (a quarter of 4): its caller came in on 8 kHz mu-law, its concierge was
    # the phone one, and the booking took the caller's number as its contact
    assert last["phone_rooms"] == 1
    rooms = json.loads((out / "metrics.json").read_text())["rooms"]
    assert [r["room"] for r in rooms if r["phone"]] == ["room_001"]
    assert {r.contact for r in booked} == {"+15550100001"}


def test_simulation_reports_a_rooms_forwarding_failure_and_books_through_the_real_tools(
    tmp_path, monkeypatch
):
    """The rooms in this process (the engine in its own), 3 rooms (2 calling tools) for 10 s. The third room's
    input converter raises once (an injected fault: nothing in the path fails on valid frames): that room is
    reported failed and the exit code says so, while its audio keeps flowing and the other rooms are
    untouched. The booking the script forced went through the real tool: the reservation is in the database,
    and its confirmation code is in the tool output the room sent the engine."""
    import agent.duplex
    from agent.sim import simulate
    from engine.client.handle import RemoteHandle
    from tools.hotel import Hotel
    from tools.store import open_store

    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path / "data"))
    converters: list = []
    faulted: list = []
    real_push = agent.duplex.InputConverter.push

    def push(self, frame):
        if self not in converters:
            converters.append(self)
        if len(converters) > 2 and self is converters[2] and not faulted:
            faulted.append(self)
            raise RuntimeError("injected converter fault")
        return real_push(self, frame)

    monkeypatch.setattr(agent.duplex.InputConverter, "push", push)
    outputs: list[str] = []
    real_submit = RemoteHandle.submit_tool_result

    def submit(self, call_id, output, is_error=False):
        outputs.append(output)
        return real_submit(self, call_id, output, is_error)

    monkeypatch.setattr(RemoteHandle, "submit_tool_result", submit)
    p = __import__("argparse").ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(
        ["--rooms", "3", "--tool-rooms", "2", "--seconds", "10", "--out", str(tmp_path / "sim")]
    )
    simulate.check_arguments(args)
    m = asyncio.run(simulate.simulate(args))
    rooms = json.loads((tmp_path / "sim" / "metrics.json").read_text())["rooms"]
    print(m, [(r["room"], r["error"], r["frames_pushed"], r["frames_in"]) for r in rooms])
    assert m["room_errors"] == 1 and simulate.exit_code(m) == 1
    assert rooms[2]["error"] == "caller audio forwarding failed 1 times"
    assert rooms[2]["frames_in"] == rooms[2]["frames_pushed"] > 100  # the forwarding went on after the fault
    assert [r["error"] for r in rooms[:2]] == [None, None]
    with open_store() as store:
        booked = Hotel(store).reservations()
    assert [r.guest_name for r in booked] == ["Sim Birch"]
    assert any(booked[0].code in out for out in outputs)


def test_the_simulation_builds_its_engine_from_every_engine_setting(tmp_path, monkeypatch):
    """The worker's settings-to-engine mapping is the simulation's too: the context windows, capacity mode and
    admission of the environment reach its engine, and its flags win over the environment."""
    from agent.sim import simulate

    monkeypatch.setenv("CHORUS_THINKER_WINDOW", "64")
    monkeypatch.setenv("CHORUS_TALKER_WINDOW", "48")
    monkeypatch.setenv("CHORUS_CAPACITY_MODE", "true")
    monkeypatch.setenv("CHORUS_REFUSE_WHEN_OVERLOADED", "false")
    monkeypatch.setenv("CHORUS_SLOTS", "7")
    p = __import__("argparse").ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--rooms", "2", "--out", str(tmp_path / "sim")])
    simulate.check_arguments(args)
    cfg = simulate.engine_config(args)  # what the engine's process is started with, as JSON
    assert type(cfg).model_validate_json(cfg.model_dump_json()) == cfg
    assert (cfg.thinker_window, cfg.talker_window, cfg.capacity_mode) == (64, 48, True)
    assert cfg.refuse_when_overloaded is False
    assert cfg.num_slots == 2  # one slot per room: the simulation's own default, over CHORUS_SLOTS
    assert cfg == args.settings.engine_config(num_slots=2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--preset", "huge"], "simulate: --preset huge: unknown; choose one of"),
        (["simulate", "--rooms", "4", "--tool-rooms", "16"], "simulate: --tool-rooms 16: give 0 to 4"),
        (["simulate", "--rooms", "4", "--phone-rooms", "5"], "simulate: --phone-rooms 5: give 0 to 4"),
        (
            ["simulate", "--checkpoint", "/no/such/model"],
            "simulate: --checkpoint /no/such/model: no such file",
        ),
        (["start"], "start: set LIVEKIT_URL"),
        # a worker whose store has no hotel would fail every job: it says so before it registers
        (["start", "LIVEKIT"], "start: the booking store has no hotel: run `python -m tools seed` once"),
    ],
)
def test_bad_input_gets_one_line_and_a_non_zero_exit(argv, message, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_") and k != "DATABASE_URL"}
    env["CHORUS_DATA_DIR"] = str(tmp_path / "data")  # an empty store
    if argv[-1] == "LIVEKIT":
        argv = argv[:-1]
        env.update(LIVEKIT_URL="ws://127.0.0.1:9", LIVEKIT_API_KEY="k", LIVEKIT_API_SECRET="s" * 32)
    proc = run_python_module("agent", *argv, cwd=tmp_path, env=env, timeout=120)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_simulation_stops_cleanly_and_writes_its_figures(tmp_path, sig):
    """Ctrl-C (or SIGTERM) during the talk: the rooms are closed, the partial figures are written and printed
    as for a finished run, no traceback, exit 130."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CHORUS_DATA_DIR")}
    out = tmp_path / "sim"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "simulate", "--rooms", "2", "--seconds", "600", "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # progress lines, one a second
        lines.append(line)
        if line.startswith("[talk") and "2/2" in line:
            break
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    print("".join(lines[-3:]), rest[-2000:], err[-2000:])
    assert proc.returncode == 130
    last = json.loads(rest.strip().splitlines()[-1])
    assert last["ended"] == "interrupted" and last["rooms_live"] == 2 and last["occupancy_after"] == 0.0
    assert json.loads((out / "metrics.json").read_text())["summary"] == last
    assert "Traceback" not in rest + err


def test_the_worker_gives_back_the_slot_of_a_job_that_ended_before_its_call_opened(seeded_env, monkeypatch):
    """Only the worker's key may release a slot (engine/door/gate.py): the worker watches its running jobs and
    releases each that ended (a no-op for one whose session took its slot)."""
    from types import SimpleNamespace

    monkeypatch.setattr(worker, "RELEASE_SWEEP_S", 0.05)
    settings = AgentSettings(slots=2, refuse_when_overloaded=False)
    engine = worker.shared_engine(settings)
    try:
        assert engine.admit("AJ_ends") == "AJ_ends" and engine.admit("AJ_stays") == "AJ_stays"
        assert engine.status()["available"] == 0
        running = [
            SimpleNamespace(job=SimpleNamespace(id="AJ_ends")),
            SimpleNamespace(job=SimpleNamespace(id="AJ_stays")),
        ]
        server = SimpleNamespace(active_jobs=running)

        async def main():
            sweep = asyncio.create_task(worker.ChorusServer._release_ended_jobs(server, engine))
            await asyncio.sleep(0.3)
            before = engine.status()["available"]
            server.active_jobs = running[1:]  # AJ_ends ended; AJ_stays still runs
            await await_until(lambda: engine.status()["available"] == 1, "the ended job's slot", timeout=10)
            await asyncio.sleep(0.3)
            sweep.cancel()
            return before, engine.status()["available"]

        before, after = asyncio.run(main())
        assert (before, after) == (0, 1)
    finally:
        worker.close_shared()


@pytest.mark.parametrize("room_processes", [True, False])
def test_callers_who_arrive_together_at_an_idle_worker_are_each_offered_a_slot(room_processes):
    # LiveKit asks a worker whether it is available for each job; livekit-agents answers with its load plus
    # an estimate for each job accepted but not launched yet, which it sizes by the warm job runners (with
    # none running). A worker with sixteen slots and four room processes waiting must not turn the fifth of
    # six callers who arrive together away
    settings = AgentSettings(slots=16, http_port=0, warm_rooms=4, room_processes=room_processes)
    server = worker.build_server(settings)
    server._devmode, server._worker_load = False, 0.0
    assert server._num_idle_processes == (4 if room_processes else 16)  # one room process per slot: 1.8 GB
    for reserved, available in ((6, True), (15, True), (16, False)):
        server._reserved_slots = reserved
        assert server._is_available() is available, reserved
