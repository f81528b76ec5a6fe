"""Joining a room without risking the worker.

After it answers a connect, the `livekit` rtc SDK's native library (the version agent/audio_in names) waits 15
s for the SDK's `ReadyForRoomEventRequest`, the last statement of `Room.connect`; if none comes it reports a
panic, and the SDK answers every panic with SIGTERM to its own process, every other room of the worker
included. A `Room.connect` cancelled by a timeout (or by the job's shutdown) never sends it. `connect()`
therefore never cancels a connect in flight: when its bound passes it lets the connect finish, leaves the
room, and then fails the job. (The FFI client itself is made safe for many job threads by
agent/audio_in/rtc_ffi.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from livekit.agents import JobContext

from agent import call_trace

log = logging.getLogger("chorus.agent.room_connect")

LATE_CONNECT_S = 30.0  # after the bound, how long a connect in flight is given to finish before the job ends


class NotJoined(RuntimeError):
    """The job could not join its room: it ends (the fleet's watch sends its caller another agent)."""


class ConnectTimeout(NotJoined):
    pass


async def connect(ctx: JobContext, timeout_s: float, late_s: float = LATE_CONNECT_S) -> None:
    """`ctx.connect()` bounded by `timeout_s` without ever cancelling it. A connect still in flight at the
    bound, or when the job is cancelled, is given `late_s` more to finish (so the native library gets its
    ready request), then the room is left and ConnectTimeout (or the cancellation) is raised. A connect the
    SDK gave up on (its signal connection timed out through its retries: a server too busy to answer) is
    logged in one line and raised as NotJoined. The call's span `chorus.room.join` (agent/call_trace.py)."""
    with call_trace.current().step("chorus.room.join"):
        await _connect(ctx, timeout_s, late_s)


async def _connect(ctx: JobContext, timeout_s: float, late_s: float) -> None:
    from livekit import rtc

    task = asyncio.ensure_future(ctx.connect())
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
        return
    except TimeoutError:
        log.warning("job %s: no room connection after %.0f s; the job ends", ctx.job.id, timeout_s)
        await _settle(ctx, task, late_s)
        raise ConnectTimeout(f"job {ctx.job.id}: no room connection after {timeout_s:.0f} s") from None
    except asyncio.CancelledError:
        await _settle(ctx, task, late_s)
        raise
    except rtc.ConnectError as e:
        log.warning("job %s: the room could not be joined (%s); the job ends", ctx.job.id, e)
        raise NotJoined(f"job {ctx.job.id}: the room could not be joined") from None


async def _settle(ctx: JobContext, task: asyncio.Future, late_s: float) -> None:
    """Let a connect in flight end (bounded), then leave the room if it joined."""
    done, _ = await asyncio.wait({task}, timeout=late_s)
    if not done:
        # the native library has not answered within its own signal timeouts and retries; cancelling now is
        # the only way left to end the job, and is safe only if no connect callback is still to come
        log.error("job %s: the room connection did not settle within %.0f s more", ctx.job.id, late_s)
        task.cancel()
        _forget_room_queue(ctx)
        return
    # the connect task's own failure was handled where it ran; only its end matters here
    with contextlib.suppress(Exception):
        task.result()
    if ctx.room.isconnected():
        with contextlib.suppress(Exception):  # a room whose server is gone cannot be left cleanly: dropped
            await asyncio.wait_for(ctx.room.disconnect(), 10.0)


def _forget_room_queue(ctx: JobContext) -> None:
    """A cancelled `Room.connect` leaves the room's FFI subscription behind, on a loop that is
    about to close."""
    from livekit.rtc._ffi_client import FfiClient

    queue = getattr(ctx.room, "_ffi_queue", None)
    if queue is not None:
        FfiClient.instance.queue.unsubscribe(queue)
