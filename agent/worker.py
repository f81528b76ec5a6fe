"""The LiveKit worker: every room is a job thread of this one process, and all of them share one engine.

`server` is the `AgentServer` that livekit-agents' CLI finds in this module (`python -m livekit.agents start
agent/worker.py`, `lk agent dev`, `lk agent console`; `python -m agent dev|start|console` runs the same
object). Building it reads the settings and sizes the startup timeout; the engine itself is built when the
worker runs (`setup_fnc`, or the first load poll), and LiveKit credentials are needed only to connect.
It has the THREAD executor, and reports the engine's load scaled to the LiveKit server's target load
(`CHORUS_LOAD_TARGET`, the server's `agents.target_load`, 0.7 by default) with that as its threshold, so
LiveKit offers rooms until the last slot is taken and none once the engine has no headroom left. `run_job` is
the entrypoint: connect, wait for a caller (standard or SIP), run the hotel agent until the caller leaves; a
phone caller gets the phone concierge (agent/phone.py), which can also transfer the call or hang up.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from livekit import rtc
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobProcess, JobRequest, cli

from agent import room_connect, rtc_ffi
from agent.call import ConsoleSink, start_call
from agent.drain import DrainingServer, goodbye_on_drain
from agent.playout import RoomSink
from agent.settings import AgentSettings
from engine.collector import freeze_long_lived
from engine.privacy import mask_numbers

if TYPE_CHECKING:
    from livekit.agents import Agent

    from agent.phone import PhoneLine
    from engine.engine import Engine

log = logging.getLogger("chorus.agent.worker")

CALLER_KINDS = [rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD, rtc.ParticipantKind.PARTICIPANT_KIND_SIP]

# How long livekit-agents waits for a job runner's `setup_fnc`, which builds the engine, before it gives up on
# that runner: a base for imports, the device and the engine's warm-up, plus the time to read the weights.
CONNECT_TIMEOUT_S = 45.0  # a job that has not joined its room by then fails, instead of waiting forever
CALLER_WAIT_S = 120.0  # a job whose room has no caller by then ends
STARTUP_BASE_S = 120.0
STARTUP_S_PER_GB = 10.0  # 100 MB/s: a slow network disk

_lock = threading.Lock()
_engine: Engine | None = None
_hotel: Any = None
_admissions: dict[str, object] = {}  # job id -> the engine slot reserved when the job was accepted


def shared_engine(settings: AgentSettings) -> Engine:
    """The process's one engine, built on first use by whichever thread asks first."""
    global _engine
    if _engine is None:
        with _lock:
            if _engine is None:
                from engine.engine import Engine

                _engine = Engine(settings.engine_config())
                atexit.register(close_shared)  # its tick thread stops before the interpreter does
    return _engine


def shared_hotel() -> Any:
    """The process's one booking store (its own connection pool), opened on first use."""
    global _hotel
    if _hotel is None:
        with _lock:
            if _hotel is None:
                from tools.hotel import Hotel
                from tools.store import open_store

                _hotel = Hotel(open_store())
    return _hotel


def close_shared() -> None:
    """Stop the process's engine and close its store (at worker exit, or between tests)."""
    global _engine, _hotel
    with _lock:
        if _engine is not None:
            _engine.close()
        if _hotel is not None:
            _hotel.store.close()
        _engine = _hotel = None


def engine_load(settings: AgentSettings) -> float:
    """What LiveKit is told: the share of slots in use (or 1.0 while the engine refuses sessions for lack of
    headroom) times the server's target load. The server gives a worker a room only while its load is under
    that target (its share is target - load): reporting the bare share would stop the rooms at 70% of the
    slots with LiveKit's default 0.7."""
    return settings.load_target * float(shared_engine(settings).load)


def weight_bytes(settings: AgentSettings) -> int:
    """What the engine reads or builds at startup: the checkpoint's size on disk, or without one the preset's
    parameters (counted on the meta device by `python -m engine info`) at 2 bytes each, as in a bf16 file."""
    if settings.checkpoint:
        path = Path(settings.checkpoint)
        path = path / "model.safetensors" if path.is_dir() else path
        return path.stat().st_size if path.is_file() else 0  # a missing file fails the engine's own check
    from engine.info import report
    from engine.presets import load_preset

    return 2 * report(load_preset(settings.preset), gpu_mem_gb=0.0)["params_total"]


def startup_timeout_s(settings: AgentSettings) -> float:
    """Seconds a job runner may take to start: `CHORUS_STARTUP_TIMEOUT_S` when set, else a base plus seconds
    per GB of weights (about five and a half minutes for the 11B preset's 22 GB, two for `tiny`)."""
    if settings.startup_timeout_s is not None:
        return settings.startup_timeout_s
    return STARTUP_BASE_S + STARTUP_S_PER_GB * weight_bytes(settings) / 1e9


class RoomNumberMask(logging.Filter):
    """A phone call's room is named after the caller's number (the SIP dispatch rule:
    `call-_+14155550123_AbCd`), and livekit-agents logs the room's name as a field of its records: it leaves
    the worker by its last four digits (`call-_•••• 0123_AbCd`)."""

    FIELDS = ("room", "room_name")

    def filter(self, record: logging.LogRecord) -> bool:
        for name in self.FIELDS:
            value = getattr(record, name, None)
            if isinstance(value, str):
                setattr(record, name, mask_numbers(value))
        return True


ROOM_NUMBER_MASK = RoomNumberMask()


def build_server(settings: AgentSettings) -> AgentServer:
    """The worker for these settings (`server` below is the one for the environment's)."""
    logging.getLogger("livekit.agents").addFilter(ROOM_NUMBER_MASK)  # the framework's own records
    kwargs: dict[str, Any] = {}
    if settings.http_port is not None:
        kwargs["port"] = settings.http_port
    server = DrainingServer(
        job_executor_type=JobExecutorType.THREAD,
        drain_timeout=int(settings.drain_timeout_s),
        # One warm job runner (a thread) per slot. livekit-agents also sizes the load of a job it accepted but
        # has not launched yet as 1 / num_idle_processes: with its default (the cores, at most 4) callers who
        # arrive together are turned away as soon as two or three are in flight, whatever the free slots.
        num_idle_processes=settings.slots,
        load_fnc=lambda: engine_load(settings),
        load_threshold=settings.load_target,  # full: every slot in use, or no headroom
        setup_fnc=lambda proc: _setup(proc, settings),
        initialize_process_timeout=startup_timeout_s(settings),
        prometheus_port=settings.prometheus_port,
        ws_url=settings.livekit_url or None,
        api_key=settings.livekit_api_key or None,
        api_secret=settings.livekit_api_secret or None,
        **kwargs,
    )

    @server.rtc_session(agent_name=settings.agent_name, on_request=lambda req: on_request(req, settings))
    async def entrypoint(ctx: JobContext) -> None:
        await run_job(ctx, settings)

    return server


async def on_request(request: JobRequest, settings: AgentSettings) -> None:
    """Accept a job only with a slot reserved for it: LiveKit samples the worker's load every 0.5 s, so it can
    offer more rooms than there are free slots (livekit-agents issue #4884). A refused job goes to another
    worker; an accepted caller is never refused by the engine afterwards (the reservation is its slot)."""
    from agent.drain import DRAIN
    from engine.api import EngineError

    if DRAIN.started.is_set():
        log.info("job %s turned away: the worker is draining", request.id)
        await request.reject()
        return
    try:
        ticket = shared_engine(settings).admit()
    except EngineError as e:
        log.info("job %s turned away: %s", request.id, e)
        await request.reject()
        return
    with _lock:
        _admissions[request.id] = ticket
    try:
        await request.accept()
    except BaseException:
        release_admission(request.id, settings)
        raise


def take_admission(job_id: str) -> object | None:
    """The slot reserved when this job was accepted (None if it lapsed or was never made)."""
    with _lock:
        return _admissions.pop(job_id, None)


def release_admission(job_id: str, settings: AgentSettings) -> None:
    ticket = take_admission(job_id)
    if ticket is not None:
        shared_engine(settings).release(ticket)


def _setup(proc: JobProcess, settings: AgentSettings) -> None:
    # runs once per job thread; the engine itself is built once per process
    rtc_ffi.install()  # before any job of this process can touch the rtc SDK
    proc.userdata["engine"] = shared_engine(settings)
    freeze_long_lived()  # the job process's own objects, once


async def run_job(ctx: JobContext, settings: AgentSettings) -> None:
    """One room: the caller talks to the hotel agent until they leave; then the slot is freed. Under the
    console (`lk agent console`) the caller is this machine's microphone and speaker, and the agent's voice
    reaches that speaker through the same playout buffer, barge-in cut and clips as a room's track."""
    engine = shared_engine(settings)

    async def release(_reason: str = "") -> None:
        release_admission(ctx.job.id, settings)  # a job that ended before its call opened

    ctx.add_shutdown_callback(release)
    # the job fails (and is logged) rather than holding a runner and a slot forever; a connect in flight is
    # never cancelled (agent/room_connect.py)
    await room_connect.connect(ctx, CONNECT_TIMEOUT_S)
    caller = await _wait_for_caller(ctx)
    if caller is None:
        return
    console = cli.AgentsConsole.get_instance().enabled
    kind = "sip" if caller.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP else "standard"
    kind = "console" if console else kind
    log.info("job %s: %s caller joined", ctx.job.id, kind)
    left = _left_event(ctx, caller)
    hotel = await asyncio.to_thread(shared_hotel)
    agent, line = concierge_for(
        settings,
        hotel,
        phone=kind == "sip",
        room=ctx.room.name,
        identity=caller.identity,
        attributes=dict(caller.attributes),
        job_id=ctx.job.id,
        job_metadata=ctx.job.metadata,
    )
    call = await start_call(
        engine,
        agent,
        sink=ConsoleSink() if console else RoomSink(),
        room=ctx.room,
        participant=caller.identity,
        admission=take_admission(ctx.job.id),
    )
    call.session.on("close", lambda _ev: left.set())
    if line is not None:
        line.attach(call.output)
        ctx.add_shutdown_callback(line.aclose)
    ctx.add_shutdown_callback(call.aclose)
    _run_alongside(ctx, call, engine, line, settings, left)
    try:
        await left.wait()
    finally:
        await call.aclose()
        log.info("job %s: call ended (%s)", ctx.job.id, call_figures(call))
    ctx.shutdown("the caller left")


async def _wait_for_caller(ctx: JobContext) -> rtc.RemoteParticipant | None:
    """The room's caller, or None (and the job shut down) when none comes within CALLER_WAIT_S."""
    try:
        async with asyncio.timeout(CALLER_WAIT_S):
            return await ctx.wait_for_participant(kind=CALLER_KINDS)
    except TimeoutError:
        log.info("job %s: no caller within %.0f s; the job ends", ctx.job.id, CALLER_WAIT_S)
        ctx.shutdown("no caller")
        return None


def _left_event(ctx: JobContext, caller: rtc.RemoteParticipant) -> asyncio.Event:
    """Set when the caller leaves the room or the room is gone."""
    left = asyncio.Event()

    def on_left(p: rtc.RemoteParticipant) -> None:
        if p.identity == caller.identity:
            left.set()

    ctx.room.on("participant_disconnected", on_left)
    ctx.room.on("disconnected", lambda *_: left.set())
    return left


def _run_alongside(ctx: JobContext, call, engine, line, settings: AgentSettings, left: asyncio.Event) -> None:
    """What runs beside the call until it ends: the teacher-forcing script (dummy weights only), the goodbye
    a draining worker speaks, and the shutdown callbacks that stop them and end the wait on `left`."""
    script: asyncio.Task | None = None
    if settings.teacher_forcing:
        from agent.forcing import Script, run_script

        script = asyncio.create_task(run_script(call, engine, Script.from_metadata(ctx.job.metadata)))

    async def hang_up() -> None:
        if line is not None:
            await line.act("end")  # the phone call ends (the SIP bridge sends BYE); a failure is logged
        left.set()

    goodbye = asyncio.create_task(
        goodbye_on_drain(call, engine, hang_up, before=script.cancel if script else None)
    )

    async def stop_tasks(_reason: str = "") -> None:
        for task in (script, goodbye):
            if task is not None:
                task.cancel()

    async def on_shutdown(_reason: str = "") -> None:
        left.set()

    ctx.add_shutdown_callback(stop_tasks)
    ctx.add_shutdown_callback(on_shutdown)


def call_figures(call) -> str:
    """A finished call's counters for the log: frames, turns, barge-ins, what played (no words, no numbers
    of the caller's)."""
    d = call.duplex.stats if call.duplex is not None else {}
    p = call.output.stats
    keys = ("frames_pushed", "frames_out", "speech_frames", "turns", "barge_ins", "function_calls")
    parts = [f"{k} {d[k]}" for k in keys if k in d]
    parts += [f"{k} {p[k]:.1f}" if isinstance(p[k], float) else f"{k} {p[k]}" for k in sorted(p)]
    return ", ".join(parts)


def concierge_for(
    settings: AgentSettings,
    hotel: Any,
    *,
    phone: bool,
    room: str,
    identity: str,
    attributes: dict[str, str],
    job_id: str,
    job_metadata: str | None = None,
) -> tuple[Agent, PhoneLine | None]:
    """The caller's agent: a web caller's `HotelAgent`, or for a phone caller (a SIP participant) the
    `PhoneConcierge` with its `PhoneLine` (transfer, hang-up, their number for bookings)."""
    from agent.hotel import HotelAgent
    from agent.phone import PHONE_NUMBER_ATTRIBUTE, PhoneConcierge, PhoneLine

    if not phone:
        return HotelAgent(hotel, session_key=job_id), None
    line = PhoneLine(settings, room=room, identity=identity, number=attributes.get(PHONE_NUMBER_ATTRIBUTE))
    return PhoneConcierge(hotel, line, purpose=call_purpose(job_metadata), session_key=job_id), line


def call_purpose(metadata: str | None) -> str:
    """Why the hotel placed this call: the `reason` that `python -m agent sip call` put in the job's metadata
    ("" for an incoming call, or metadata that is not ours)."""
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        return ""
    reason = meta.get("reason") if isinstance(meta, dict) else None
    return reason.strip()[:500] if isinstance(reason, str) else ""


def _server_from_env() -> AgentServer:
    """The environment's worker; a bad setting is one line and exit status 2, also when livekit-agents' own
    CLI (`python -m livekit.agents start agent/worker.py`, `lk agent ...`) imports this file."""
    try:
        return build_server(AgentSettings.from_env())
    except ValueError as e:  # SettingsError
        print(f"chorus worker: {e}", file=sys.stderr)
        raise SystemExit(2) from None


server = _server_from_env()
"""The worker livekit-agents' CLI discovers in this module (see the module docstring)."""
