"""The LiveKit worker: the process that registers with LiveKit, starts the one engine (and its tick) in a
process of its own, and runs each room's call (agent/room.py) in a process of its own (with
`CHORUS_ROOM_PROCESSES=false`, a thread of its own), which reaches the engine through its door
(engine/door/host.py: a socket and shared memory per session).

`server` is the `AgentServer` that livekit-agents' CLI finds in this module (`python -m livekit.agents start
agent/worker.py`, `lk agent dev`, `lk agent console`; `python -m agent dev|start|console` runs the same
object), built when first looked up, not on import. Building it reads the settings and sizes the startup
timeout; the engine is built when the worker runs, before the first room's process starts, and LiveKit
credentials are needed only to connect. Rooms run in livekit-agents' process executor (threads of this process
with `CHORUS_ROOM_PROCESSES=false`, and under the console). The worker reports the engine's load scaled to the
LiveKit server's target load (`CHORUS_LOAD_TARGET`, the server's `agents.target_load`, 0.7 by default) with
that as its threshold, so LiveKit offers rooms until the last slot is taken and none once the engine has no
headroom left; a job is accepted only with a slot reserved for it (`on_request`), which its room's session
takes.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from livekit.agents import AgentServer, AssignmentTimeoutError, JobExecutorType, JobRequest
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from livekit.agents.worker import ServerEnvOption

from agent import telemetry, tracing
from agent.call import room_label
from agent.fleet.drain import DrainingServer
from agent.fleet.kept import forget_conversations, start_keeping
from agent.log_privacy import mask_log_handlers
from agent.room import entrypoint
from agent.room_process import close_room, prewarm
from agent.settings import AgentSettings
from agent.startup import HEALTH_PORTS as HEALTH_PORTS  # where a worker's health port is looked for
from agent.startup import exit_on_failed_start, free_health_port, port_problem

if TYPE_CHECKING:
    from agent.fleet.engine_watch import EngineWatch
    from engine.client.control import EngineControl

log = logging.getLogger("chorus.agent.worker")

# How long livekit-agents waits for a job runner's `setup_fnc` before it gives up on that runner: a base for
# imports, the device and the engine's warm-up, plus the time to read the weights (the worker's own start).
STARTUP_BASE_S = 120.0
STARTUP_S_PER_GB = 10.0  # 100 MB/s: a slow network disk

ROOM_MODULES = [
    "agent.room",
    "agent.hotel",
    "agent.phone.phone",
    "agent.forcing",
    "tools.hotel",
    "tools.store",
]

_lock = threading.Lock()
_engine: EngineControl | None = None
_watch: EngineWatch | None = None


def shared_engine(settings: AgentSettings, startup_s: float | None = None) -> EngineControl:
    """The worker's engine: its process (`python -m engine.door.serve`), started on first use by whichever
    thread asks first and waited for until its door is open (at most `startup_s`, by default
    `startup_timeout_s`); what is returned is the worker's end of that door (admission, load, drain), with the
    worker's own key. Its address and the rooms' key go into this process's environment, where the rooms find
    them (a room's own process inherits them); the worker's key stays in this process's memory. The process is
    watched (agent/fleet/engine_watch.py): one that dies is started again at the same address with the same
    keys."""
    global _engine, _watch
    if _engine is None:
        with _lock:
            if _engine is None:
                from agent.fleet.engine_watch import EngineWatch
                from engine.client.control import EngineControl
                from engine.client.process import EngineProcess
                from engine.transport.wire import ADDRESS_ENV, KEY_ENV

                prompts, traces = agent_prompts(settings), telemetry.engine_variables()  # OTEL_* as read here
                config = settings.engine_config(warm_prompts=prompts, traces=traces).model_dump_json()
                timeout = startup_timeout_s(settings) if startup_s is None else startup_s
                process = EngineProcess(config, timeout=timeout).start()
                os.environ[ADDRESS_ENV] = process.address
                os.environ[KEY_ENV] = process.keys.room
                control = EngineControl(process.address, process.keys.control)
                _watch = EngineWatch(process, control).start()
                _engine = control
                atexit.register(close_shared)  # the engine's process ends with the worker
                log.info("engine ready for rooms (%d slots)", settings.slots)
    return _engine


def agent_prompts(settings: AgentSettings) -> list:
    """The prompts and tools of this worker's agents, for its engine to prefill at start (and at every start
    again): a web caller's concierge and an incoming phone caller's (their number on file). Calls carried on
    after a break then prefill only their earlier turns. Empty where the hotel cannot be read now: the calls
    prefill them as they come."""
    from agent.hotel import HotelAgent, tool_schemas
    from agent.phone.phone import PhoneConcierge, PhoneLine
    from agent.room_process import shared_hotel
    from engine.config.engine_config import WarmPrompt

    try:
        hotel = shared_hotel()
        line = PhoneLine(settings, room="", identity="", number="+0")
        agents = [HotelAgent(hotel), PhoneConcierge(hotel, line)]
        return [WarmPrompt(prompt=str(a.instructions), tools=tool_schemas(a)) for a in agents]
    except Exception as e:  # noqa: BLE001 (the store down at start: nothing is lost but the head start)
        log.warning("the agents' prompts are not prefilled at start (%s)", type(e).__name__)
        return []


def close_shared() -> None:
    """Stop the engine's process and close the rooms' store (at worker exit, between tests)."""
    global _engine, _watch
    with _lock:
        if _watch is not None:
            _watch.stop()
        _engine = _watch = None
    close_room()


def engine_load(settings: AgentSettings) -> float:
    """What LiveKit is told: the share of slots in use (or 1.0 while the engine refuses sessions for lack of
    headroom) times the server's target load. The server gives a worker a room only while its load is under
    that target (its share is target - load): reporting the bare share would stop the rooms at 70% of the
    slots with LiveKit's default 0.7."""
    engine = shared_engine(settings)
    watch = _watch
    down = watch is not None and watch.down  # its process died and is being started again
    return settings.load_target * (1.0 if down else engine.load)


def engine_watch() -> EngineWatch | None:
    """The watch on the worker's engine's process (None before the engine is started)."""
    return _watch


def weight_bytes(settings: AgentSettings) -> int:
    """What the engine reads or builds at startup: the checkpoint's size on disk, or without one the preset's
    parameters (counted on the meta device by `python -m engine info`) at 2 bytes each, as in a bf16 file."""
    if settings.checkpoint:
        path = Path(settings.checkpoint)
        path = path / "model.safetensors" if path.is_dir() else path
        return path.stat().st_size if path.is_file() else 0  # a missing file fails the engine's own check
    from engine.config.presets import load_preset
    from engine.sizing.info import report

    return 2 * report(load_preset(settings.preset), gpu_mem_gb=0.0)["params_total"]


def warm_runners(settings: AgentSettings) -> int:
    """The job runners started ahead of their callers: `CHORUS_WARM_ROOMS` room processes (at most the
    slots), or with the rooms as threads one runner per slot."""
    return min(settings.warm_rooms, settings.slots) if settings.room_processes else settings.slots


def startup_timeout_s(settings: AgentSettings) -> float:
    """Seconds a job runner may take to start: `CHORUS_STARTUP_TIMEOUT_S` when set, else a base plus seconds
    per GB of weights (about five and a half minutes for the 11B preset's 22 GB, two for `tiny`)."""
    if settings.startup_timeout_s is not None:
        return settings.startup_timeout_s
    return STARTUP_BASE_S + STARTUP_S_PER_GB * weight_bytes(settings) / 1e9


# livekit-agents watches every job's event loop for blocking with a tick every 20 ms at its default
# threshold (100 ms): two wake-ups per tick per room, and a stack sample of the loop's thread whenever the
# GIL was busy elsewhere. At 250 ms its ticks are 50 ms apart; a block that long still gets its warning
# and its stack.
LOOP_BLOCK_WARN_MS = 250
PRELOAD_LOCAL_INFERENCE = "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE"  # livekit-agents' (ipc/_preload.py)
RELEASE_SWEEP_S = 1.0  # how often the worker looks for jobs that ended (their unused slots given back)


def build_server(settings: AgentSettings) -> AgentServer:
    """The worker for these settings (`server` below is the one for the environment's). Its log handlers,
    livekit-agents' CLI's once the worker starts, carry no caller's data (agent/log_privacy.py)."""
    mask_log_handlers()
    telemetry.configure("worker")  # OTEL_*: off without an endpoint; a bad value is refused here
    # (read as each job starts)
    os.environ.setdefault("LIVEKIT_AGENTS_LOOP_BLOCK_WARN_MS", str(LOOP_BLOCK_WARN_MS))
    # livekit-agents loads its own voice-activity and end-of-turn models into every job's process (the
    # worker's, with rooms as threads: about 250 MB) for agents that use them; a call here never does, the
    # model hears and decides by itself (agent/call.py)
    os.environ.setdefault(PRELOAD_LOCAL_INFERENCE, "0")
    kwargs: dict[str, Any] = {}
    if settings.http_port is not None:
        kwargs["port"] = settings.http_port
    else:  # livekit-agents' own default (any free port under `dev`), the next free one when it is taken
        kwargs["port"] = ServerEnvOption(dev_default=0, prod_default=free_health_port())
    server = ChorusServer(
        settings,
        job_executor_type=JobExecutorType.PROCESS if settings.room_processes else JobExecutorType.THREAD,
        drain_timeout=int(settings.drain_timeout_s),
        # The room processes waiting for their callers (a runner thread per slot: threads cost nothing
        # waiting). A job accepted but not launched yet weighs one slot (ChorusServer._get_effective_load),
        # whatever this number.
        num_idle_processes=warm_runners(settings),
        load_fnc=lambda: engine_load(settings),
        load_threshold=settings.load_target,  # full: every slot in use, or no headroom
        setup_fnc=prewarm,  # in each room's process: by reference (a process executor pickles it)
        # imported once in the forkserver that forks the rooms' processes: a room's process starts with the
        # framework and the call's code already loaded (copy-on-write), in milliseconds
        preload_modules=ROOM_MODULES if settings.room_processes else [],
        initialize_process_timeout=startup_timeout_s(settings),
        prometheus_port=settings.prometheus_port,
        ws_url=settings.livekit_url or None,
        api_key=settings.livekit_api_key or None,
        api_secret=settings.livekit_api_secret or None,
        **kwargs,
    )

    # by reference, as the setup: a process executor pickles both for each room's process
    server.rtc_session(agent_name=settings.agent_name, on_request=lambda req: on_request(req, settings))(
        entrypoint
    )

    server.on("worker_started", mask_log_handlers)  # the CLI's handler is in place by then
    server.on("worker_started", tracing.trace_log_handlers)
    exit_on_failed_start(server)  # livekit-agents' CLI would exit 0
    return server


async def on_request(request: JobRequest, settings: AgentSettings) -> None:
    """Accept a job only with a slot reserved for it: LiveKit samples the worker's load every 0.5 s, so it can
    offer more rooms than there are free slots (livekit-agents issue #4884). A refused job goes to another
    worker; an accepted caller is never refused by the engine afterwards (the reservation is its slot). The
    job's trace begins here: its span `chorus.job` (agent/tracing.py), with the outcome."""
    with tracing.job_scope(request.id, root=True):
        attributes = {"chorus.job_id": request.id, "chorus.room_label": room_label(request.room.name)}
        span = tracing.tracer().start_span(tracing.JOB_SPAN, attributes=attributes)
    outcome = "failed"
    try:
        with tracing.job_scope(request.id):  # its log lines carry the trace's id
            outcome = await _on_request(request, settings)
    finally:
        span.set_attribute("chorus.outcome", outcome)
        span.end()


async def _on_request(request: JobRequest, settings: AgentSettings) -> str:
    from agent.fleet.drain import DRAIN
    from engine.api import EngineError

    if DRAIN.started.is_set():
        log.info("job %s turned away: the worker is draining", request.id)
        await request.reject()
        return "draining"
    engine = shared_engine(settings)
    if _watch is not None and not _watch.up:
        log.info("job %s turned away: the engine is restarting", request.id)
        await request.reject()
        return "engine restarting"
    try:
        await asyncio.to_thread(engine.admit, request.id)
    except EngineError as e:
        log.info("job %s turned away: %s", request.id, e)
        await request.reject()
        return "engine refused"
    try:
        await request.accept()
    except AssignmentTimeoutError:  # the server gave the job to no one in time (a busy server): not ours
        await asyncio.to_thread(engine.release, request.id)
        log.info("job %s: accepted, but the server did not assign it in time; its slot is free", request.id)
        return "not assigned"
    except BaseException:
        await asyncio.to_thread(engine.release, request.id)
        raise
    return "accepted"


class ChorusServer(DrainingServer):
    """The worker: its engine's process is started (and waited for) when the worker runs, before it registers
    with LiveKit and before the first room's process starts; a drain is passed on to rooms in other
    processes through the engine's door."""

    def __init__(self, settings: AgentSettings, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.handing_over = False  # draining with the fleet's watch: its calls go on with other workers

    async def run(self, *, devmode: bool = False, unregistered: bool = False) -> None:
        # the ports first, whichever CLI runs the worker (`python -m agent` checked them; livekit-agents' own
        # has not): a port in use ends the start in a moment, not after the engine's seconds to minutes
        if problem := port_problem(self.settings):
            raise OSError(problem)
        keeper = await asyncio.to_thread(start_keeping, self.settings)  # the store migrated before any room
        # the startup timeout this server was built with: the weights are not sized a second time
        engine = await asyncio.to_thread(shared_engine, self.settings, self._initialize_process_timeout)
        log.info("health and /worker on port %s", ServerEnvOption.getvalue(self._port, devmode) or "any free")
        tasks = [asyncio.create_task(self._release_ended_jobs(engine)), asyncio.create_task(keeper.run())]
        if self.settings.redis_url and not unregistered and not self.settings.missing_livekit():
            from agent.fleet import worker_watch

            me = f"{socket.gethostname()}-{os.getpid()}"

            def watch(*_: Any) -> None:  # once registered: a new agent it asks for can be this worker's
                if len(tasks) == 2:
                    job = worker_watch.watch(
                        self.settings,
                        me,
                        self._running_rooms,
                        report=engine.report_fleet,
                        handing_over=lambda: self.handing_over,
                        over=None if self.settings.keep_conversations else forget_conversations,
                    )
                    tasks.append(asyncio.create_task(job))

            self.on("worker_registered", watch)
        elif not unregistered:
            log.warning("CHORUS_REDIS_URL is unset: a room whose agent dies is not given another")
        try:
            await super().run(devmode=devmode, unregistered=unregistered)
        finally:
            for task in tasks:
                task.cancel()

    def _get_effective_load(self) -> float:
        """The load LiveKit's availability requests are answered with (livekit-agents', replaced: the version
        agent/audio_in names): the engine's, plus a slot's share for each job accepted but not launched yet.
        livekit-agents weighs such a job as its target load over the warm runners (with none running): a few
        callers who arrive together at an idle worker would be turned away with slots free."""
        return self._worker_load + self._reserved_slots * self.settings.load_target / self.settings.slots

    def _running_rooms(self) -> list[tuple[str, str]]:
        """(room sid, job id) of each job this worker runs, oldest first: agent/fleet/fleet.py marks their
        rooms live (of two jobs for one room, the oldest whose link is not down)."""
        try:
            jobs = sorted(self.active_jobs, key=lambda i: i.received_at or i.launched_at)
            return [(i.job.room.sid, i.job.id) for i in jobs if i.job.room.sid]
        except AttributeError:  # the server is not running yet
            return []

    async def _release_ended_jobs(self, engine: EngineControl) -> None:
        """Give back the slot of every job that ended before its call opened a session (only the worker may:
        engine/door/gate.py). A job is watched from when it runs; one that is no longer running is released,
        which is a no-op for a job whose session took its slot. A job admitted but never launched lapses in
        the engine (ADMISSION_TTL_S)."""
        running: set[str] = set()
        while True:
            await asyncio.sleep(RELEASE_SWEEP_S)
            try:
                now = {info.job.id for info in self.active_jobs}
            except Exception:  # noqa: BLE001 (the server is not running yet, or is closing)
                continue
            for job in running - now:
                await asyncio.to_thread(engine.release, job)
            running = now

    async def drain(self, timeout: NotGivenOr[int | None] = NOT_GIVEN) -> None:
        seconds = float(timeout) if isinstance(timeout, int | float) and timeout else self.drain_s
        # with the fleet's watch (agent/fleet/fleet.py), each call is handed to an agent of another worker; a
        # call none takes over in time ends with the drain's goodbye (agent/fleet/drain.py)
        self.handing_over = bool(self.settings.redis_url)
        if _engine is not None:
            await asyncio.to_thread(_engine.drain, seconds)
        await super().drain(timeout)


def _server_from_env() -> AgentServer:
    """The environment's worker; a bad setting is one line and exit status 2, also when livekit-agents' own
    CLI (`python -m livekit.agents start agent/worker.py`, `lk agent ...`) looks the server up."""
    try:
        return build_server(AgentSettings.from_env())
    except ValueError as e:  # SettingsError
        print(f"chorus worker: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def __getattr__(name: str) -> Any:
    """`server`: the worker livekit-agents' CLI discovers in this module (see the module docstring), built
    from the environment when first asked for, not on import."""
    if name != "server":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global server
    server = _server_from_env()
    return server


def __dir__() -> list[str]:
    """The module's names and `server`: livekit-agents' discovery looks it up among them."""
    return sorted({*globals(), "server"})
