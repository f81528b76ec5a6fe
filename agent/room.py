"""A room's side of the worker: the job that runs one room's call, in the room's own process (livekit-agents'
process executor, the default) or, under the console and with `CHORUS_ROOM_PROCESSES=false`, in a thread of
the worker's.

`prewarm` (agent/room_process.py) readies a room's process before its job (the rtc SDK's FFI client, the
engine's door: engine/client/remote.py); `entrypoint` is the job: connect, wait for a caller (standard or
SIP), run the hotel agent until the caller leaves; a phone caller gets the phone concierge
(agent/phone/phone.py), which can also transfer the call or hang up. The engine is the worker's
(agent/worker.py), reached through its socket and shared memory; this module imports nothing of torch, so a
room's process starts in a fraction of a second and stays small. Knows livekit-agents jobs, rooms and calls;
nothing of the engine's internals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from livekit import rtc
from livekit.agents import JobContext, cli

from agent import call_trace, room_connect, telemetry
from agent.audio_in.receive_stats import ReceiveWatch
from agent.audio_out.sinks import ConsoleSink, RoomSink
from agent.call import start_call
from agent.call_figures import call_figures
from agent.call_trace import CallTrace
from agent.concierge import concierge_for
from agent.fleet.carry import ConversationLog, acknowledgement, back_again, forget_rooms, resume_context
from agent.fleet.drain import DRAIN, goodbye_on_drain
from agent.fleet.presence import REPLACED, ROOM_CLOSED, CallerPresence
from agent.fleet.room_job import holder, redispatched, release_room, room_gone, take_room, watch_link
from agent.fleet.state import CALLER_KINDS as FLEET_CALLER_KINDS
from agent.fleet.state import REASON_KEY, Reason
from agent.fleet.takeover import _heard_first, _hold_on, _replace_lost_agent, _take_over
from agent.joins import join_gate
from agent.log_privacy import CALLER_DATA_MASK, mask_log_handlers
from agent.room_process import room_engine, room_settings, shared_hotel
from agent.settings import AgentSettings

if TYPE_CHECKING:
    from agent.phone.phone import PhoneLine

log = logging.getLogger("chorus.agent.room")

CALLER_KINDS = list(FLEET_CALLER_KINDS)  # the fleet's callers' kinds: the rtc SDK's values are the API's
SESSION_CLOSED = "the session closed"  # the call's end when its session closed under it (its engine failed)
CONNECT_TIMEOUT_S = 45.0  # a job that has not joined its room by then fails, instead of waiting forever
CALLER_WAIT_S = 120.0  # a job whose room has no caller by then ends


async def entrypoint(ctx: JobContext) -> None:
    """The job: a room's call (in the room's own process), one trace (agent/call_trace.py) that ends with the
    call's reason to end."""
    trace = CallTrace(ctx.job.id, room=ctx.job.room.name)
    trace.activate()  # the call's session and playout report to it
    try:
        await run_job(ctx, room_settings())
    finally:  # sent now: the job's process may not outlive its shutdown long
        trace.end(trace.reason)
        await asyncio.to_thread(telemetry.flush)


async def run_job(ctx: JobContext, settings: AgentSettings) -> None:
    """One room: the caller talks to the hotel agent until they leave; then the slot is freed. Under the
    console (`lk agent console`) the caller is this machine's microphone and speaker, and the agent's voice
    reaches that speaker through the same playout buffer, barge-in cut and clips as a room's track."""
    mask_log_handlers()  # a handler the job added (livekit-agents' cloud recording) too
    engine = room_engine()
    # a job that ends before its call opens leaves its reserved slot to the worker to give back
    # (agent/worker.py `_release_ended_jobs`): only the worker's key may release a slot

    async def redispatch_if_lost(reason: str = "") -> None:
        # the rtc connection gave up, not the caller nor the worker; with the fleet's watch
        # (agent/fleet/fleet.py) the room, alone, gets its new agent from there
        if reason == "room disconnected" and not settings.redis_url:
            await redispatch(ctx, settings)

    ctx.add_shutdown_callback(redispatch_if_lost)
    # the job ends (and says why) rather than holding a runner and a slot forever; a connect in flight is
    # never cancelled (agent/room_connect.py)
    joins = join_gate(settings.joins_at_once)
    try:
        async with joins.turn():
            await room_connect.connect(ctx, CONNECT_TIMEOUT_S)
    except room_connect.NotJoined as e:  # logged where it was found; the job ends without a stack
        ctx.shutdown(str(e))
        return
    replacing = redispatched(ctx.job.metadata)
    if settings.redis_url and (other := await holder(settings, ctx.job.room.sid, ctx.job.id)) is not None:
        # the room was made again on another node (the server dispatches its agent again), or two jobs were
        # dispatched to it: the job that holds it keeps it if its agent is in the room as this job sees it
        agent = rtc.ParticipantKind.PARTICIPANT_KIND_AGENT
        if any(p.kind == agent for p in ctx.room.remote_participants.values()):
            log.info("job %s: the room is job %s's, whose agent is in it; this job leaves", ctx.job.id, other)
            ctx.shutdown("the room has its agent")
            return
        log.warning("job %s: the room's job %s has no agent in it; this job takes it over", ctx.job.id, other)
        await take_room(settings, ctx.job.room.sid, other)
        replacing = {REASON_KEY: Reason.AGENT_LOST.value}
    handed_over = replacing is not None and replacing.get(REASON_KEY) == Reason.HANDED_OVER.value
    if replacing is not None and not handed_over:  # a lost agent's place: taken at once, its remains removed
        # beside the call (a room made again after its node died answers that removal only after a timeout)
        ctx.add_shutdown_callback(_cancel_on_end(asyncio.create_task(_replace_lost_agent(ctx, settings))))
    caller, over = await _wait_for_caller(ctx, settings)
    if caller is None:
        if over and replacing is not None:
            await _ended_in_the_silence(settings, ctx.job.room.sid)
        return
    CALLER_DATA_MASK.learn(ctx.room.name, caller.identity)  # their names, in any log line, as their labels
    console = cli.AgentsConsole.get_instance().enabled
    kind = "sip" if caller.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP else "standard"
    kind = "console" if console else kind
    log.info("job %s: %s caller joined", ctx.job.id, kind)
    presence = CallerPresence(ctx.room, caller.identity, job=ctx.job.id)
    left = presence.left
    _end_call_on_shutdown(ctx, presence)
    hotel = await asyncio.to_thread(shared_hotel)
    # what the call has said and done, kept while it lasts; a job that replaces a lost agent carries it on
    convo = await ConversationLog.open(
        hotel.store,
        ctx.job.room.sid,
        ctx.job.id,
        resumed=replacing is not None,
        keep=settings.keep_conversations,
    )
    c = convo.conversation
    if convo.resumed:  # its trace links to the trace of the call it carries on (agent/call_trace.py)
        reason = str((replacing or {}).get(REASON_KEY, ""))
        call_trace.current().carried_on(c.last_job or c.key, reason, c.breaks, c.saved_at)
    c.last_job = ctx.job.id
    agent, line = concierge_for(
        settings,
        hotel,
        phone=kind == "sip",
        room=ctx.room.name,
        identity=caller.identity,
        attributes=dict(caller.attributes),
        job_id=convo.conversation.key,  # the conversation's: a booking asked for again after a break is one
        job_metadata=ctx.job.metadata,
    )
    if convo.resumed:
        log.info(
            "job %s: carries the call on after a break (%d before)", ctx.job.id, convo.conversation.breaks
        )
    sink = ConsoleSink() if console else RoomSink(takes=engine.model_cfg.clock.output_rate)
    if line is not None and not await _answered(ctx, caller, line, sink):
        ctx.shutdown("the caller left")
        return
    if handed_over:  # the caller takes this agent's track before its first words (the old one talks on)
        await _heard_first(ctx, sink, CALLER_KINDS)
    async with joins.turn():
        call = await start_call(
            engine,
            agent,
            sink=sink,
            room=ctx.room,
            participant=caller.identity,
            admission=ctx.job.id,  # the slot reserved when this worker accepted the job (`on_request`)
            context=resume_context(convo.conversation) if convo.resumed else "",
        )
    call.duplex.record = convo
    # lines the call asks its script for as things happen (dummy weights only): a dropped line come back
    cues: asyncio.Queue[str] | None = asyncio.Queue() if settings.teacher_forcing else None
    if cues is not None:
        presence.on_back = lambda: cues.put_nowait(back_again())
    if settings.redis_url:  # the agent's own connection: down, the fleet steps in; back replaced, it leaves

        def link_changed(down: bool) -> None:
            convo.hold(down)
            if not down and cues is not None:
                cues.put_nowait(back_again())

        def replaced() -> None:
            convo.hold(True)
            presence.end(REPLACED)

        link = watch_link(
            ctx.room, settings, ctx.job.room.sid, ctx.job.id, link_changed, replaced, DRAIN.started.is_set
        )
        ctx.add_shutdown_callback(_cancel_on_end(asyncio.create_task(link)))
    call.session.on("close", lambda _ev: presence.end(SESSION_CLOSED))
    if line is not None:
        line.attach(call.output)
        ctx.add_shutdown_callback(line.aclose)
    ctx.add_shutdown_callback(call.aclose)
    if handed_over:  # the draining agent talks on until this one's session is live, then leaves
        ctx.add_shutdown_callback(_cancel_on_end(asyncio.create_task(_take_over(ctx, settings, call))))
    elif replacing is not None:  # the caller has been in silence since the break: not a moment more
        ctx.add_shutdown_callback(_cancel_on_end(asyncio.create_task(_hold_on(call))))
    _run_alongside(
        ctx, call, engine, line, settings, presence, resumed=convo.resumed, handed_over=handed_over, cues=cues
    )
    try:
        done = [left.wait()] if line is None else [left.wait(), line.finished.wait()]
        await _first(*done)
        if line is not None and line.finished.is_set():
            # ended on purpose by the line's transfer or hang-up, not by the session's close that follows:
            # the room is released, and no agent is sent to a caller the bridge has not yet taken out of it
            presence.end(f"the phone call was {line.outcome}")
    finally:
        await call.aclose()
        why = presence.reason or "the agent ended it"
        call_trace.current().end(why)
        await asyncio.to_thread(telemetry.flush)  # the call's spans sent now (at most the export's timeout)
        log.info("job %s: call ended, %s (%s)", ctx.job.id, why, call_figures(call, line, presence))
    if why not in (SESSION_CLOSED, ROOM_CLOSED, REPLACED):
        # ended on purpose; a session that failed, or a connection to the room that closed under the agent,
        # leaves its caller to the fleet, and its conversation to the agent that replaces this one
        await convo.forget()
        await release_room(settings, ctx.job.room.sid)
    else:
        await convo.flush()
    ctx.shutdown(
        "the caller left" if line is None or line.outcome != "transferred" else "the call was handed over"
    )


def _end_call_on_shutdown(ctx: JobContext, presence: CallerPresence) -> None:
    """A job told to shut down while its call runs (`ctx.shutdown`, by whatever part of the job) ends the call
    now, as one ended on purpose: livekit-agents waits 15 s for an entrypoint that does not notice, then
    cancels it, and the call's slot and store stay held meanwhile."""
    shutdown = ctx.shutdown

    def shutdown_now(reason: str = "user requested") -> None:
        presence.end(f"the job was shut down ({reason})")
        shutdown(reason)

    ctx.shutdown = shutdown_now  # type: ignore[method-assign]


def _cancel_on_end(task: asyncio.Task, wait_s: float = 3.0):
    """A shutdown callback: `task` cancelled, and waited for (at most `wait_s`) to finish what its end does
    (the link's watch leaves a lost connection's room marked down) before the job's process exits."""

    async def cancel(*_args: Any) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)

    return cancel


async def _answered(ctx: JobContext, caller: rtc.RemoteParticipant, line: PhoneLine, sink: RoomSink) -> bool:
    """A phone call before its session starts: the caller's keypad presses go to the line, the agent's track
    is published (the bridge answers the phone once it has subscribed to it), and the call waits until it is
    answered, so that the agent's first words reach the phone. False if the caller left first."""
    from agent.phone.phone import answered

    def on_dtmf(ev: rtc.SipDTMF) -> None:
        if ev.participant is not None and ev.participant.identity == caller.identity:
            line.on_dtmf(ev.digit)

    ctx.room.on("sip_dtmf_received", on_dtmf)
    await sink.start(ctx.room)
    if await answered(ctx.room, caller.identity):
        return True
    await sink.aclose()
    log.info("job %s: the caller left before the call was answered", ctx.job.id)
    return False


async def _first(*waits) -> None:
    """Until the first of `waits` (coroutines) is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_caller(
    ctx: JobContext, settings: AgentSettings
) -> tuple[rtc.RemoteParticipant | None, bool]:
    """The room's caller; or None (and the job shut down) when none comes within CALLER_WAIT_S or the room
    closes first, with whether the room's call is over: no caller came in all that time, or the server no
    longer holds the room (everyone left it, or it was deleted). A connection lost is not: the room may be
    made again on another node, its caller back."""
    try:
        async with asyncio.timeout(CALLER_WAIT_S):
            return await ctx.wait_for_participant(kind=CALLER_KINDS), False
    except TimeoutError:
        log.info("job %s: no caller within %.0f s; the job ends", ctx.job.id, CALLER_WAIT_S)
        ctx.shutdown("no caller")
        return None, True
    except RuntimeError:  # the room disconnected while the job waited
        ctx.shutdown("the room closed")
        gone = await room_gone(settings, ctx.room.name, ctx.job.room.sid)
        log.info(
            "job %s: the room %s before a caller came; the job ends",
            ctx.job.id,
            "closed" if gone else "was lost",
        )
        return None, gone


async def _ended_in_the_silence(settings: AgentSettings, sid: str) -> None:
    """A job sent to carry a lost agent's call on found no caller: they hung up in the silence, and no job is
    left to end that call on purpose. Its conversation is deleted (kept if an operator turned keeping on) and
    its room released."""
    if not settings.keep_conversations:
        try:
            hotel = await asyncio.to_thread(shared_hotel)
            await asyncio.to_thread(forget_rooms, hotel.store, [sid])
        except Exception as e:  # noqa: BLE001 (purged after KEEP_S)
            log.warning("the conversation could not be deleted (%s)", type(e).__name__)
    await release_room(settings, sid)


def _run_alongside(
    ctx: JobContext,
    call,
    engine,
    line,
    settings: AgentSettings,
    presence: CallerPresence,
    *,
    resumed: bool = False,
    handed_over: bool = False,
    cues: asyncio.Queue[str] | None = None,
) -> None:
    """What runs beside the call until it ends: the teacher-forcing script (dummy weights only), the goodbye
    a draining worker speaks, and the shutdown callbacks that stop them and end the call (`presence`)."""
    script: asyncio.Task | None = None
    fault: asyncio.Task | None = None
    if settings.teacher_forcing:
        from agent.forcing import Script, run_script

        lines = Script.from_metadata(ctx.job.metadata)
        if resumed:  # the first words acknowledge the break, as a greeting would open the call
            lines = dataclasses.replace(lines, greeting=acknowledgement(handed_over))
        script = asyncio.create_task(run_script(call, engine, lines, cues))
        if lines.reconnect_at_s is not None:
            fault = asyncio.create_task(_reconnect_at(ctx, lines.reconnect_at_s))

    async def hang_up() -> None:
        if line is not None:
            await line.act("end")  # the phone call ends (the SIP bridge sends BYE); a failure is logged
        presence.end("the worker drained and said goodbye")

    goodbye = asyncio.create_task(
        goodbye_on_drain(call, engine, hang_up, before=script.cancel if script else None)
    )

    def report_receive(jitter_s: float, concealed_s: float) -> None:
        if call.handle is not None:
            call.handle.report_receive(jitter_s, concealed_s)

    receive = asyncio.create_task(ReceiveWatch(ctx.room, report_receive).run(), name="chorus.receive")

    async def stop_tasks(_reason: str = "") -> None:
        for task in (script, goodbye, fault, receive):
            if task is not None:
                task.cancel()

    async def on_shutdown(reason: str = "") -> None:
        presence.end(f"the job was shut down ({reason or 'no reason given'})")

    ctx.add_shutdown_callback(stop_tasks)
    ctx.add_shutdown_callback(on_shutdown)


async def _reconnect_at(ctx: JobContext, after_s: float) -> None:
    """A scripted fault (dummy weights only): the room's connection rebuilt by the rtc SDK's full reconnect
    `after_s` into the call, as the SDK does by itself after a network loss. Every remote participant leaves
    and joins again on the agent's side while it happens."""
    await asyncio.sleep(after_s)
    log.info("job %s: scripted fault: the room's connection is rebuilt (a full reconnect)", ctx.job.id)
    try:
        await ctx.room.simulate_scenario(rtc.SimulateScenarioKind.SIMULATE_FULL_RECONNECT)
    except RuntimeError as e:
        log.warning("job %s: the scripted reconnect failed (%s)", ctx.job.id, e)


async def redispatch(ctx: JobContext, settings: AgentSettings) -> bool:
    """A job whose room connection was lost, with no fleet's watch (no Redis): a new agent for its caller,
    as agent/fleet/dispatches.py's `redispatch_lost` asks. Returns whether one was asked for; every failure
    is logged, never raised."""
    from agent.fleet.dispatches import redispatch_lost
    from agent.lkapi import LiveKit, LiveKitFailure

    if settings.missing_livekit():
        return False
    agent_name = ctx.job.agent_name or settings.agent_name
    try:
        async with LiveKit(settings) as lk:
            asked = await redispatch_lost(lk, agent_name, ctx.job.room.name, ctx.job.metadata)
    except (LiveKitFailure, ValueError, TypeError) as e:
        log.warning(
            "job %s: the room's connection was lost and no new agent could be asked for (%s)", ctx.job.id, e
        )
        return False
    if asked:
        log.warning(
            "job %s: the room's connection was lost with its caller still there; a new agent was dispatched",
            ctx.job.id,
        )
    return asked
