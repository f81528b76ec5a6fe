"""Whether a room's caller is still on the line.

A caller who hung up, was removed, or whose room was closed is gone, and the call ends at once. Any other
departure is a lost connection: the server timed the caller out, their signal connection closed, or a newer
connection of theirs replaced it. Such a caller usually comes back under the same identity, because the rtc
SDKs rejoin by themselves after a network blip or a stall. The call is held for them (`REJOIN_WAIT_S`):
the agent stays in the room, its track stays published, and the returning caller is heard again. A hotel
line that dropped every caller whose network hiccuped would leave them in an empty room.
Knows rtc participants and disconnect reasons; nothing of sessions or the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from livekit import rtc

log = logging.getLogger("chorus.agent.presence")

_R = rtc.DisconnectReason
# the caller chose to leave, someone removed them, their call was never answered, or the room is gone
GONE_REASONS = frozenset(
    {
        _R.CLIENT_INITIATED,
        _R.PARTICIPANT_REMOVED,
        _R.ROOM_DELETED,
        _R.ROOM_CLOSED,
        _R.SERVER_SHUTDOWN,
        _R.USER_REJECTED,
        _R.USER_UNAVAILABLE,
        _R.SIP_TRUNK_FAILURE,
    }
)
# how long a call waits for a caller whose connection was lost; the server itself keeps an empty room for
# 20 s after its last participant leaves (its departure timeout)
REJOIN_WAIT_S = 20.0
# the call's end when the agent's own connection closed: not the caller's doing, so the room may be served
# again
ROOM_CLOSED = "the agent's connection to the room closed"
# the call's end when the agent's connection came back to a room another agent serves now
# (agent/fleet/fleet.py)
REPLACED = "another agent serves the room now"


def reason_name(reason: int | None) -> str:
    try:
        return _R.Name(reason or _R.UNKNOWN_REASON)
    except ValueError:  # a reason newer than this SDK
        return f"reason {reason}"


class CallerPresence:
    """The caller of one room's call, watched through the room's events. `left` is set when the call should
    end on the caller's side, and `reason` then says why. `lost` counts connections lost, and `rejoins`
    counts the times the caller came back. Other code may end the call too, with `end`."""

    def __init__(self, room: rtc.Room, identity: str, *, job: str = "", rejoin_wait_s: float = REJOIN_WAIT_S):
        self.left = asyncio.Event()
        self.reason: str | None = None
        self.on_back: Callable[[], None] | None = None  # the caller came back after a lost connection
        self.lost = 0
        self.rejoins = 0
        self._room, self._identity, self._job, self._wait_s = room, identity, job, rejoin_wait_s
        self._away: asyncio.TimerHandle | None = None  # the end of the hold, while the caller is away
        room.on("participant_disconnected", self._on_disconnected)
        room.on("participant_connected", self._on_connected)
        room.on("disconnected", self._on_room_disconnected)

    @property
    def away(self) -> bool:
        """The caller's connection was lost, and the call is waiting for them."""
        return self._away is not None

    def end(self, reason: str) -> None:
        """The call ends on this side now (the first reason given is kept)."""
        if self._away is not None:
            self._away.cancel()
            self._away = None
        if not self.left.is_set():
            self.reason = reason
            self.left.set()

    def _on_disconnected(self, p: rtc.RemoteParticipant) -> None:
        if p.identity != self._identity or self.left.is_set():
            return
        name = reason_name(p.disconnect_reason)
        if p.disconnect_reason in GONE_REASONS or self._wait_s <= 0:
            self.end(f"the caller left ({name})")
            return
        self.lost += 1
        back = self._room.remote_participants.get(self._identity)
        if back is not None and back.sid != p.sid:  # a newer connection of theirs already replaced this one
            self.rejoins += 1
            log.info("job %s: the caller's connection was replaced by a new one (%s)", self._job, name)
            self._back()
            return
        if self._away is None:
            log.info(
                "job %s: the caller's connection was lost (%s); the call waits %g s for them",
                self._job,
                name,
                self._wait_s,
            )
            reason = f"the caller's connection was lost ({name}), not back in {self._wait_s:g} s"
            self._away = asyncio.get_running_loop().call_later(self._wait_s, self.end, reason)

    def _on_connected(self, p: rtc.RemoteParticipant) -> None:
        if p.identity != self._identity or self._away is None:
            return
        self._away.cancel()
        self._away = None
        self.rejoins += 1
        log.info("job %s: the caller is back", self._job)
        self._back()

    def _back(self) -> None:
        if self.on_back is not None:
            self.on_back()

    def _on_room_disconnected(self, *_args) -> None:
        self.end(ROOM_CLOSED)
