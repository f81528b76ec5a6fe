"""A call's caller on the line (agent/fleet/presence.py): a caller who hung up ends the call at once; one
whose connection was lost is waited for, and the call goes on when they come back. The room is the rtc SDK's
own event emitter, fed the events a real room emits; the real server's side is in tests/test_livekit.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from livekit import rtc

from agent.fleet.presence import CallerPresence

R = rtc.DisconnectReason


class Room(rtc.EventEmitter):
    def __init__(self) -> None:
        super().__init__()
        self.remote_participants: dict[str, SimpleNamespace] = {}

    def join(self, identity: str, sid: str) -> SimpleNamespace:
        p = SimpleNamespace(identity=identity, sid=sid, disconnect_reason=None)
        self.remote_participants[identity] = p
        self.emit("participant_connected", p)
        return p

    def drop(self, p: SimpleNamespace, reason: int) -> None:
        p.disconnect_reason = reason
        if self.remote_participants.get(p.identity) is p:
            del self.remote_participants[p.identity]
        self.emit("participant_disconnected", p)


def test_a_caller_who_hangs_up_or_is_removed_ends_the_call_at_once():
    async def main() -> list[str]:
        reasons = []
        for why in (R.CLIENT_INITIATED, R.PARTICIPANT_REMOVED, R.ROOM_DELETED, R.USER_REJECTED):
            room = Room()
            caller = room.join("caller", "PA_1")
            presence = CallerPresence(room, "caller", rejoin_wait_s=5.0)
            room.drop(caller, why)
            assert presence.left.is_set() and not presence.away
            reasons.append(presence.reason)
        return reasons

    reasons = asyncio.run(main())
    assert reasons == [
        "the caller left (CLIENT_INITIATED)",
        "the caller left (PARTICIPANT_REMOVED)",
        "the caller left (ROOM_DELETED)",
        "the caller left (USER_REJECTED)",
    ]


@pytest.mark.parametrize("why", [R.CONNECTION_TIMEOUT, R.SIGNAL_CLOSE, R.UNKNOWN_REASON])
def test_a_caller_whose_connection_was_lost_is_waited_for_and_the_call_goes_on_when_they_come_back(why):
    """UNKNOWN_REASON is what the agent's side sees of every participant while its own connection is rebuilt
    (the rtc SDK's full reconnect drops them all, then adds them again)."""

    async def main() -> CallerPresence:
        room = Room()
        caller = room.join("caller", "PA_1")
        presence = CallerPresence(room, "caller", rejoin_wait_s=0.3)
        presence.on_back = lambda: backs.append(presence.away)
        room.drop(caller, why)
        assert presence.away and not presence.left.is_set() and not backs
        room.join("caller", "PA_2")  # the SDK's full reconnect: the same identity, a new participant
        assert not presence.away
        await asyncio.sleep(0.5)  # past the first wait: the call was not ended by it
        assert not presence.left.is_set()
        return presence

    backs: list[bool] = []
    presence = asyncio.run(main())
    assert (presence.lost, presence.rejoins, presence.reason) == (1, 1, None)
    assert backs == [False]  # told once the caller is back (the agent says the line dropped)


def test_a_caller_who_does_not_come_back_ends_the_call_after_the_wait():
    async def main() -> tuple[CallerPresence, float]:
        room = Room()
        caller = room.join("caller", "PA_1")
        presence = CallerPresence(room, "caller", rejoin_wait_s=0.3)
        t0 = asyncio.get_running_loop().time()
        room.drop(caller, R.SIGNAL_CLOSE)
        room.join("someone-else", "PA_9")  # another participant is not the caller coming back
        await asyncio.wait_for(presence.left.wait(), 5.0)
        return presence, asyncio.get_running_loop().time() - t0

    presence, waited = asyncio.run(main())
    assert waited >= 0.3
    assert presence.reason == "the caller's connection was lost (SIGNAL_CLOSE), not back in 0.3 s"
    assert (presence.lost, presence.rejoins) == (1, 0)


def test_a_connection_replaced_by_a_newer_one_of_the_callers_keeps_the_call():
    """The server closes a participant's old connection (DUPLICATE_IDENTITY) once their new one has joined."""

    async def main() -> CallerPresence:
        room = Room()
        old = room.join("caller", "PA_1")
        presence = CallerPresence(room, "caller", rejoin_wait_s=0.3)
        presence.on_back = lambda: backs.append(1)
        room.join("caller", "PA_2")
        room.drop(old, R.DUPLICATE_IDENTITY)
        await asyncio.sleep(0.5)
        assert not presence.left.is_set() and not presence.away
        return presence

    backs: list[int] = []
    presence = asyncio.run(main())
    assert (presence.lost, presence.rejoins) == (1, 1) and backs == [1]


def test_others_leaving_is_not_the_caller_and_the_rooms_end_ends_the_call():
    async def main() -> CallerPresence:
        room = Room()
        room.join("caller", "PA_1")
        other = room.join("agent-2", "PA_3")
        presence = CallerPresence(room, "caller", rejoin_wait_s=0.3)
        room.drop(other, R.CLIENT_INITIATED)
        assert not presence.left.is_set()
        room.emit("disconnected", R.ROOM_DELETED)
        assert presence.left.is_set()
        presence.end("later")  # the first reason stays
        return presence

    presence = asyncio.run(main())
    assert presence.reason == "the agent's connection to the room closed"
