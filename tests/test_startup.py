"""A worker or a simulation that cannot start says why in one line naming the setting and exits non-zero:
a port in use, a number out of bounds, a booking store that cannot be opened. Each runs the real command
(`python -m agent start | dev | simulate`, or livekit-agents' own CLI on agent/worker.py) as a subprocess,
with the port held by the test; no LiveKit server is needed, the checks come before one is reached."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.settings import AgentSettings
from envsettings import SettingsError
from tools.settings import StoreSettings

ROOT = Path(__file__).resolve().parent.parent
LIVEKIT = {"LIVEKIT_URL": "ws://127.0.0.1:9", "LIVEKIT_API_KEY": "k", "LIVEKIT_API_SECRET": "s" * 32}
TIMEOUT_S = 180


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process's server listens on (this test's), on every interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def hotel(tmp_path) -> Path:
    """A seeded SQLite hotel: a worker with these settings would otherwise start."""
    from tools.seed import seed
    from tools.store import open_store

    data = tmp_path / "data"
    data.mkdir()
    with open_store(StoreSettings(data_dir=data)) as store:
        seed(store, dt.date.today())
    return data


def env(**values: str) -> dict[str, str]:
    """This process's environment without any Chorus or LiveKit setting, plus `values`: the engine on the
    CPU, two slots, so a worker that does start its engine starts it quickly."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CHORUS_", "LIVEKIT_")) and k != "DATABASE_URL"
    }
    return {**base, "PYTHONPATH": str(ROOT), "CHORUS_DEVICE": "cpu", "CHORUS_SLOTS": "2", **values}


def run(args: list[str], cwd: Path, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    print(proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return proc


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The run's stderr, asserted to be one line, and no traceback anywhere."""
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["start", "dev"])
@pytest.mark.parametrize("name", ["CHORUS_HTTP_PORT", "CHORUS_PROMETHEUS_PORT", "CHORUS_METRICS_PORT"])
def test_a_port_in_use_is_one_line_and_a_non_zero_exit(tmp_path, hotel, held_port, command, name):
    proc = run(
        ["agent", command], tmp_path, env(**LIVEKIT, CHORUS_DATA_DIR=str(hotel), **{name: str(held_port)})
    )
    assert proc.returncode == 2
    assert one_line(proc) == f"{command}: {name}: port {held_port} is in use"


def test_two_servers_on_one_port_are_refused_before_either_starts(tmp_path, hotel, held_port):
    # the settings are told apart first: the port being in use too is not what is wrong with them
    settings = {"CHORUS_HTTP_PORT": str(held_port), "CHORUS_PROMETHEUS_PORT": str(held_port)}
    proc = run(["agent", "start"], tmp_path, env(**LIVEKIT, CHORUS_DATA_DIR=str(hotel), **settings))
    assert proc.returncode == 2
    assert one_line(proc) == f"start: CHORUS_PROMETHEUS_PORT: port {held_port} is CHORUS_HTTP_PORT too"


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("CHORUS_SLOTS", "1000000000", "a whole number from 1 to 4096"),
        ("CHORUS_DRAIN_TIMEOUT_S", "1e400", "a number of seconds above 0, at most 86400"),
    ],
)
@pytest.mark.parametrize("command", ["start", "simulate"])
def test_an_absurd_number_is_refused_in_one_line(tmp_path, hotel, command, name, value, allowed):
    out = tmp_path / "sim"
    args = ["agent", command, *(["--seconds", "1", "--out", str(out)] if command == "simulate" else [])]
    proc = run(args, tmp_path, env(**LIVEKIT, CHORUS_DATA_DIR=str(hotel), **{name: value}))
    assert proc.returncode == 2
    assert one_line(proc) == f"{command}: {name}={value}: must be {allowed}"
    assert not out.exists()


def unreachable_database() -> str:
    with socket.socket() as s:  # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://chorus:hunter2@127.0.0.1:{port}/hotel"


@pytest.mark.parametrize("command", ["start", "simulate"])
@pytest.mark.parametrize("where", ["DATABASE_URL", "CHORUS_DATA_DIR"])
def test_a_booking_store_that_cannot_be_opened_is_one_line(tmp_path, command, where):
    out = tmp_path / "sim"
    if where == "DATABASE_URL":
        settings, named = {"DATABASE_URL": unreachable_database(), "CHORUS_DB_WAIT_S": "1"}, "DATABASE_URL"
    else:  # a file where the folder should be: unwritable whoever runs it (root too)
        (tmp_path / "not-a-folder").write_text("")
        folder = tmp_path / "not-a-folder" / "data"
        settings, named = {"CHORUS_DATA_DIR": str(folder)}, f"CHORUS_DATA_DIR={folder}"
    args = ["agent", command, *(["--seconds", "1", "--out", str(out)] if command == "simulate" else [])]
    proc = run(args, tmp_path, env(**LIVEKIT, **settings))
    assert proc.returncode == 2
    line = one_line(proc)
    assert line.startswith(f"{command}: {named}: the booking store cannot be opened (")
    assert "hunter2" not in proc.stdout + proc.stderr
    assert not out.exists()  # nothing of a run was written


def test_livekit_agents_own_cli_exits_non_zero_when_the_worker_cannot_start(tmp_path, hotel, held_port):
    # `python -m livekit.agents start agent/worker.py` (what `lk agent` runs) has no check of its own before
    # the worker runs: the worker's run finds the health port in use before its engine starts, and the
    # process ends with one line
    environment = env(**LIVEKIT, CHORUS_DATA_DIR=str(hotel), CHORUS_HTTP_PORT=str(held_port))
    proc = run(["livekit.agents", "start", str(ROOT / "agent" / "worker.py")], tmp_path, environment)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("chorus worker:")]
    assert said == [f"chorus worker: cannot start (OSError: CHORUS_HTTP_PORT: port {held_port} is in use)"], (
        proc.stderr
    )
    assert "engine ready" not in proc.stdout + proc.stderr  # found before the engine started
    assert "worker failed" not in proc.stdout  # nor drained: it never started


@pytest.mark.parametrize(
    "name, value",
    [
        ("CHORUS_DRAIN_TIMEOUT_S", "inf"),
        ("CHORUS_DRAIN_TIMEOUT_S", "nan"),
        ("CHORUS_DRAIN_TIMEOUT_S", "86401"),
        ("CHORUS_STARTUP_TIMEOUT_S", "1e400"),
        ("CHORUS_LIVEKIT_API_TIMEOUT_S", "Infinity"),
        ("CHORUS_SIP_RING_TIMEOUT_S", "-inf"),
        ("CHORUS_LOAD_TARGET", "nan"),
        ("CHORUS_SLOTS", "4097"),
        ("CHORUS_TALKER_WINDOW", "1000000000000"),
        ("CHORUS_THINKER_WINDOW", "1048577"),
        ("CHORUS_DB_WAIT_S", "nan"),
        ("CHORUS_DB_WAIT_S", "601"),
        ("CHORUS_DB_POOL_SIZE", "1000000"),
        ("CHORUS_MONITOR_REFRESH_S", "nan"),
    ],
)
def test_every_number_is_finite_and_bounded(monkeypatch, tmp_path, name, value):
    from ui.settings import MonitorSettings

    monkeypatch.chdir(tmp_path)  # no .env
    for variable in list(os.environ):
        if variable.startswith(("CHORUS_", "LIVEKIT_")) or variable == "DATABASE_URL":
            monkeypatch.delenv(variable)
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=f"^{name}={value}: must be "):
        AgentSettings.from_env()
        StoreSettings.from_env()
        MonitorSettings.from_env()


def test_the_largest_values_allowed_are_accepted(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CHORUS_SLOTS", "4096")
    monkeypatch.setenv("CHORUS_DRAIN_TIMEOUT_S", "86400")
    monkeypatch.setenv("CHORUS_DB_POOL_SIZE", "1024")
    agent, store = AgentSettings.from_env(), StoreSettings.from_env()
    assert (agent.slots, agent.drain_timeout_s, store.pool_size) == (4096, 86400.0, 1024)
    assert agent.engine_config().num_slots == 4096  # the engine takes what the settings allow


def test_a_port_zero_made_in_code_is_any_free_port_and_never_a_problem(held_port):
    from agent.startup import port_problem

    assert port_problem(AgentSettings(http_port=0, prometheus_port=0, metrics_port=0)) is None
    assert (
        port_problem(AgentSettings(metrics_port=held_port))
        == f"CHORUS_METRICS_PORT: port {held_port} is in use"
    )


@pytest.mark.parametrize("flag", [False, True])
def test_a_simulation_whose_snapshot_port_is_in_use_is_one_line(tmp_path, held_port, flag):
    out = tmp_path / "sim"
    args = ["agent", "simulate", "--seconds", "1", "--out", str(out)]
    settings = {} if flag else {"CHORUS_METRICS_PORT": str(held_port)}
    proc = run([*args, *(["--metrics-port", str(held_port)] if flag else [])], tmp_path, env(**settings))
    assert proc.returncode == 2
    named = "--metrics-port" if flag else "CHORUS_METRICS_PORT"
    assert one_line(proc) == f"simulate: {named}: port {held_port} is in use"
    assert not out.exists()
