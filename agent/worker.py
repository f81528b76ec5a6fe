"""The LiveKit worker: every room is a job thread of this one process, and all of them share one engine.

`build_server` makes an `AgentServer` with the THREAD executor, the engine's load as its load and a load
threshold of 1.0, so LiveKit sends no more rooms once the slots are taken or the engine has no headroom left. `run_job` is the entrypoint:
connect, wait for a caller (standard or SIP), run the hotel agent until the caller leaves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

from livekit import rtc
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobProcess

from agent.call import quiet_gc, start_call
from agent.playout import RoomSink
from agent.settings import AgentSettings

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("chorus.agent.worker")

CALLER_KINDS = [rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD, rtc.ParticipantKind.PARTICIPANT_KIND_SIP]

_lock = threading.Lock()
_engine: Engine | None = None
_hotel: Any = None


def shared_engine(settings: AgentSettings) -> Engine:
    """The process's one engine, built on first use by whichever thread asks first."""
    global _engine
    if _engine is None:
        with _lock:
            if _engine is None:
                from engine.engine import Engine, EngineConfig

                _engine = Engine(
                    EngineConfig(
                        preset=settings.preset,
                        num_slots=settings.slots,
                        checkpoint=settings.checkpoint,
                        device=settings.device,
                        metrics_port=settings.metrics_port,
                    )
                )
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
    """The share of slots in use, or 1.0 while the engine refuses sessions for lack of headroom."""
    return float(shared_engine(settings).load)


def build_server(settings: AgentSettings) -> AgentServer:
    kwargs: dict[str, Any] = {}
    if settings.http_port is not None:
        kwargs["port"] = settings.http_port
    server = AgentServer(
        job_executor_type=JobExecutorType.THREAD,
        load_fnc=lambda: engine_load(settings),
        load_threshold=1.0,
        setup_fnc=lambda proc: _setup(proc, settings),
        prometheus_port=settings.prometheus_port,
        ws_url=settings.livekit_url or None,
        api_key=settings.livekit_api_key or None,
        api_secret=settings.livekit_api_secret or None,
        **kwargs,
    )

    @server.rtc_session(agent_name=settings.agent_name)
    async def entrypoint(ctx: JobContext) -> None:
        await run_job(ctx, settings)

    return server


def _setup(proc: JobProcess, settings: AgentSettings) -> None:
    # runs once per job thread; the engine itself is built once per process
    proc.userdata["engine"] = shared_engine(settings)
    quiet_gc()


async def run_job(ctx: JobContext, settings: AgentSettings) -> None:
    """One room: the caller talks to the hotel agent until they leave; then the slot is freed."""
    from agent.hotel import HotelAgent

    engine = shared_engine(settings)
    await ctx.connect()
    caller = await ctx.wait_for_participant(kind=CALLER_KINDS)
    kind = "sip" if caller.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP else "standard"
    log.info("job %s: %s caller joined", ctx.job.id, kind)

    left = asyncio.Event()

    def on_left(p: rtc.RemoteParticipant) -> None:
        if p.identity == caller.identity:
            left.set()

    ctx.room.on("participant_disconnected", on_left)
    ctx.room.on("disconnected", lambda *_: left.set())
    agent = HotelAgent(await asyncio.to_thread(shared_hotel), session_key=ctx.job.id)
    call = await start_call(engine, agent, sink=RoomSink(), room=ctx.room, participant=caller.identity)
    call.session.on("close", lambda _ev: left.set())
    ctx.add_shutdown_callback(call.aclose)

    async def on_shutdown(_reason: str = "") -> None:
        left.set()

    ctx.add_shutdown_callback(on_shutdown)
    try:
        await left.wait()
    finally:
        await call.aclose()
        log.info("job %s: call ended", ctx.job.id)
    ctx.shutdown("the caller left")
