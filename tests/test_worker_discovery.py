"""The worker as livekit-agents' own CLI finds it: `python -m livekit.agents start|console agent/worker.py`
(and `lk agent dev|start|console`, which run that) import agent/worker.py and take its AgentServer. Importing
it builds no engine and needs no LiveKit credentials. Under the console, the agent's voice reaches the
console's speaker through the playout, as it reaches a caller.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from livekit.agents import AgentServer, JobExecutorType, cli
from livekit.agents.cli.discover import get_import_data
from livekit.agents.cli.tcp_console import TcpAudioInput, TcpAudioOutput

from agent import room, room_process, worker
from agent.audio_out.playout import PlayoutOutput
from agent.settings import AgentSettings
from testkit.server import run_python_module
from wait_support import await_until

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "agent" / "worker.py"
FRAMEWORK_DEFAULT_STARTUP_S = 10.0  # AgentServer(initialize_process_timeout=...) when not given
GB = 10**9


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No LiveKit credentials, no Chorus settings, no .env: what a fresh machine has."""
    for name in list(os.environ):
        if name.startswith(("LIVEKIT_", "CHORUS_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # discovery puts the project's root first
    return tmp_path


def discover(monkeypatch) -> tuple[str, AgentServer, object]:
    """What `python -m livekit.agents start agent/worker.py` does: livekit-agents' discovery, on
    a fresh import."""
    import agent

    # the fresh module is this test's only: afterwards both the module table and the package's attribute name
    # the one every other test imported (its engine, admissions and FFI setup are process-wide state)
    monkeypatch.delitem(sys.modules, "agent.worker", raising=False)
    monkeypatch.delattr(agent, "worker", raising=False)
    data = get_import_data(path=WORKER)
    module = importlib.import_module(data.module_data.module_import_str)
    return data.import_string, getattr(module, data.app_name), module


def sparse_checkpoint(folder: Path, size: int) -> Path:
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(size)  # a hole: no disk used
    return folder


def test_the_cli_finds_the_worker_with_its_name_load_threshold_executor_and_startup_timeout(
    clean_env, monkeypatch
):
    monkeypatch.setenv("LIVEKIT_AGENT_NAME", "front-desk")
    monkeypatch.setenv("CHORUS_CHECKPOINT", str(sparse_checkpoint(clean_env / "release", 5 * GB)))
    where, server, module = discover(monkeypatch)
    print(where, server._agent_name, server._initialize_process_timeout)
    assert where == "agent.worker:server" and isinstance(server, AgentServer)
    assert module._engine is None  # imported, not built
    # the configuration as livekit-agents holds it (AgentServer has no public accessors for these)
    assert server._agent_name == "front-desk"
    assert server._load_threshold == 0.7  # LiveKit's default agents.target_load
    assert server._job_executor_type == JobExecutorType.PROCESS  # each room's call in a process of its
    # own (the engine in another); what the process executor hands each room's process goes by reference:
    # module-level functions
    assert pickle.loads(pickle.dumps((server._entrypoint_fnc, server._setup_fnc))) == (
        server._entrypoint_fnc,
        server._setup_fnc,
    )
    # reading a 5 GB checkpoint takes longer than the framework's default: at 100 MB/s, 50 s more
    assert server._initialize_process_timeout >= FRAMEWORK_DEFAULT_STARTUP_S + 5 * GB / 100e6
    # the load LiveKit sees is the engine's, scaled to the server's target: a full engine is exactly at it
    monkeypatch.setattr(module, "shared_engine", lambda settings: SimpleNamespace(load=0.375))
    assert server.load_fnc() == pytest.approx(0.7 * 0.375)
    monkeypatch.setattr(module, "shared_engine", lambda settings: SimpleNamespace(load=15 / 16))
    assert 0.7 - server.load_fnc() > 0  # a 16-slot worker with one slot free still has a share of rooms
    monkeypatch.setattr(module, "shared_engine", lambda settings: SimpleNamespace(load=1.0))
    assert server.load_fnc() >= server._load_threshold  # and none with none free


def test_importing_the_worker_reads_no_setting_and_builds_nothing(monkeypatch):
    """A plain `import agent.worker` builds no server: a bad setting is reported only when the CLI looks the
    server up (one line and exit status 2, the next test's)."""
    import agent

    monkeypatch.setenv("CHORUS_SLOTS", "sixty")
    monkeypatch.delitem(sys.modules, "agent.worker", raising=False)
    monkeypatch.delattr(agent, "worker", raising=False)
    module = importlib.import_module("agent.worker")
    assert "server" not in vars(module) and module._engine is None
    assert "server" in dir(module)  # what livekit-agents' discovery lists
    with pytest.raises(SystemExit) as refused:
        module.server  # noqa: B018 (the lookup builds it)
    assert refused.value.code == 2


def test_the_startup_timeout_can_be_set(clean_env, monkeypatch):
    monkeypatch.setenv("CHORUS_STARTUP_TIMEOUT_S", "900")
    _, server, _ = discover(monkeypatch)
    assert server._initialize_process_timeout == 900.0


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_startup_timeout_is_refused_in_one_line(value, monkeypatch):
    from envsettings import SettingsError

    monkeypatch.setenv("CHORUS_STARTUP_TIMEOUT_S", value)
    with pytest.raises(SettingsError) as refused:
        AgentSettings.from_env(dotenv=False)
    assert (
        str(refused.value)
        == f"CHORUS_STARTUP_TIMEOUT_S={value}: must be a number of seconds above 0, at most 86400"
    )


def test_the_startup_timeout_grows_with_the_weights(tmp_path):
    small = worker.startup_timeout_s(AgentSettings())
    ckpt = worker.startup_timeout_s(AgentSettings(checkpoint=str(sparse_checkpoint(tmp_path / "c", 22 * GB))))
    full = worker.startup_timeout_s(AgentSettings(preset="nemotron-voicechat-11b"))
    print(f"tiny {small:.0f} s, 22 GB checkpoint {ckpt:.0f} s, 11B preset (dummy weights) {full:.0f} s")
    assert FRAMEWORK_DEFAULT_STARTUP_S < small < ckpt
    # on top of the framework's default, the time to read the weights at 100 MB/s
    assert ckpt >= FRAMEWORK_DEFAULT_STARTUP_S + 22 * GB / 100e6
    assert full >= FRAMEWORK_DEFAULT_STARTUP_S + 20 * GB / 100e6  # the 11B preset is about 22 GB in bf16


# -- console ----------------------------------------------------------------------------------------------


class LkEnd:
    """The LiveKit CLI's end of the console's link (`lk agent console`), in memory: what the worker sends."""

    def __init__(self) -> None:
        self.sent: list = []
        self._closed: asyncio.Event | None = None

    async def start(self) -> None:
        self._closed = asyncio.Event()

    async def send_message(self, msg) -> None:
        self.sent.append(msg)

    def send_message_threadsafe(self, msg) -> None:
        self.sent.append(msg)

    async def close(self) -> None:
        if self._closed is not None:
            self._closed.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while self._closed is None:
            await asyncio.sleep(0.01)
        await self._closed.wait()
        raise StopAsyncIteration


class Speaker(TcpAudioOutput):
    """The console's speaker, counting the audio it is handed."""

    def __init__(self, transport) -> None:
        super().__init__(transport)
        self.received_s = 0.0

    async def capture_frame(self, frame) -> None:
        self.received_s += frame.duration
        await super().capture_frame(frame)


def test_the_console_hears_the_playout_with_its_clips(seeded_env, monkeypatch):
    """The console mode as livekit-agents runs it (`cli.cli._run_tcp_console`: a fake job in this process, the
    console's audio in and out of the session), with the LiveKit CLI's end in memory. The session's audio
    output is the call's PlayoutOutput, playing into the console's speaker: the acknowledgement clip of a tool
    call reaches it, and everything the speaker got is what the playout played."""
    console = cli.AgentsConsole()
    monkeypatch.setattr(cli.AgentsConsole, "_instance", console)
    lk = LkEnd()
    speaker = Speaker(lk)
    console.enabled = True
    console._tcp_transport = lk
    console._tcp_audio_input = TcpAudioInput()
    console._tcp_audio_output = speaker
    calls = []
    start_call = room.start_call

    async def spy(*args, **kwargs):
        calls.append(await start_call(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(room, "start_call", spy)

    async def main():
        server = worker.build_server(AgentSettings(slots=1, http_port=0, room_processes=False))
        run = asyncio.create_task(server.run(devmode=True, unregistered=True))
        await await_until(lambda: not server._closed, "the worker to start")
        await server.simulate_job("console-room", agent_identity="console", fake_job=True)
        await await_until(lambda: calls and calls[0].handle is not None, "the call's engine slot")
        call = calls[0]
        engine = room_process.room_engine()  # the room's end (a thread of the worker's here)
        wiring = (call.session.output.audio is call.output, call.output.sink.speaker is speaker)
        call_ids = engine.tokens.call_ids([{"name": "hotel_info", "arguments": {"topic": "parking"}}])
        call.handle.force_function(call_ids)
        await await_until(lambda: call.output.stats["clip_s"] > 0, "the acknowledgement clip to play")
        await await_until(lambda: speaker.received_s > 0, "audio at the console")
        played = call.output.stats["model_s"] + call.output.stats["clip_s"]
        got = speaker.received_s
        await server.aclose()
        await asyncio.wait_for(run, 90)
        return wiring, played, got, dict(call.output.stats)

    (output_is_playout, speaker_is_consoles), played, got, stats = asyncio.run(main())
    print(f"played {played:.3f} s, the console's speaker got {got:.3f} s; {stats}")
    assert output_is_playout and speaker_is_consoles
    assert isinstance(calls[0].output, PlayoutOutput)
    assert stats["clips"] >= 1 and stats["clip_s"] > 0
    # nothing reached the speaker around the playout: it got what the playout played, give or take the rest
    # of a chunk cut short (a barge-in, a clip stopped) or being handed over as the two were read
    assert played - 0.01 <= got <= played + 0.08 * (1 + stats["cuts"] + stats["clips"])


def test_a_bad_setting_is_one_line_through_livekits_own_cli(tmp_path):
    """`python -m livekit.agents start agent/worker.py` imports the worker file: a bad value there is one line
    naming the variable and exit status 2, as through `python -m agent`."""
    env = {**os.environ, "CHORUS_SLOTS": "sixty", "LIVEKIT_URL": "ws://127.0.0.1:9"}
    proc = run_python_module(
        "livekit.agents", "start", str(ROOT / "agent" / "worker.py"), cwd=tmp_path, env=env, timeout=120
    )
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "chorus worker: CHORUS_SLOTS=sixty: must be a whole number from 1 to 4096"
    assert "Traceback" not in proc.stdout + proc.stderr
