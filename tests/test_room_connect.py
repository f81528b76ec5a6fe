"""Joining a room (agent/room_connect.py) with a job context whose connect is scripted: a connect the rtc SDK
gave up on ends the job with one line of log and no stack; a connect still in flight at the bound is let
finish, the room left, and the job ends; a connect in time returns."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from livekit import rtc

from agent import room_connect


class Room:
    def __init__(self) -> None:
        self.connected = False
        self.left = False

    def isconnected(self) -> bool:
        return self.connected

    async def disconnect(self) -> None:
        self.left, self.connected = True, False


def job(connect) -> SimpleNamespace:
    room = Room()

    async def scripted() -> None:
        await connect()
        room.connected = True

    return SimpleNamespace(job=SimpleNamespace(id="AJ_test"), room=room, connect=scripted)


def test_a_connect_the_sdk_gave_up_on_ends_the_job_in_one_line(caplog):
    async def refused() -> None:
        await asyncio.sleep(0.01)
        raise rtc.ConnectError("engine: signal failure: transport timed out")

    ctx = job(refused)
    with (
        caplog.at_level(logging.WARNING, logger="chorus.agent.room_connect"),
        pytest.raises(room_connect.NotJoined, match="AJ_test"),
    ):
        asyncio.run(room_connect.connect(ctx, timeout_s=5.0))
    (record,) = caplog.records
    assert "AJ_test" in record.getMessage() and "transport timed out" in record.getMessage()
    assert record.exc_info is None and not ctx.room.left


def test_a_connect_in_flight_at_the_bound_is_let_finish_then_the_room_is_left():
    ctx = job(lambda: asyncio.sleep(0.3))
    with pytest.raises(room_connect.ConnectTimeout):
        asyncio.run(room_connect.connect(ctx, timeout_s=0.05, late_s=5.0))
    assert ctx.room.left  # it joined after the bound, and was left


def test_a_connect_in_time_returns_with_the_room_joined():
    ctx = job(lambda: asyncio.sleep(0.01))
    asyncio.run(room_connect.connect(ctx, timeout_s=5.0))
    assert ctx.room.connected and not ctx.room.left
