"""The fleet's marks (agent/fleet/fleet.py) believed only where LiveKit agrees: a mark in the cluster's Redis
is anyone's to write who can write there, while only the server puts an agent in a room. A live mark counts
for a job while LiveKit lists that job's agent in the room (`agent-<job id>`, the identity livekit-agents
gives a job's participant), or for JOIN_S after the mark was first seen or the server started the job (its
agent joining); a down mark counts for a job only while LiveKit does not list its agent in the room (in a
room made again on another node, an agent listed from before its callers came back is the dead node's). A room
whose live mark LiveKit does not agree with is served still if an agent of one of the room's jobs (as the
server's dispatches list them) is in it. Knows LiveKit's room and dispatch API; nothing of Redis, the engine
or the call.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from livekit import api

from redaction import pseudonym

if TYPE_CHECKING:
    from collections.abc import Iterable

    from agent.lkapi import LiveKit

log = logging.getLogger("chorus.agent.fleet")

# a job's mark is believed this long before its agent is in the room: a new job marks its room at launch, and
# its agent joins seconds later (more on a busy host)
JOIN_S = 10.0
# a room whose marks were forged this long ago or less: a live mark missing there is asked of LiveKit too
# (removing a forged mark, by its writer or by the room's job, leaves the room unmarked until the next beat)
FORGED_S = 30.0
AGENT = api.ParticipantInfo.Kind.AGENT
PRESENT = (api.ParticipantInfo.State.JOINED, api.ParticipantInfo.State.ACTIVE)


def agent_identity(job: str) -> str:
    """The identity of a job's agent in its room (livekit-agents' `JobRequest.accept`, as Chorus accepts)."""
    return f"agent-{job}"


def agents_in_room(people: Iterable[api.ParticipantInfo], since: int = 0) -> set[str]:
    """The identities of the agents LiveKit lists in the room, joined at `since` or later (a room made again
    on another node: an agent listed from before its callers came back is the dead node's)."""
    return {p.identity for p in people if p.kind == AGENT and p.state in PRESENT and p.joined_at >= since}


async def room_jobs(lk: LiveKit, room: str, agent_name: str) -> dict[str, api.Job]:
    """The jobs the server started for the room's dispatches of `agent_name`, by id."""
    found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
    return {j.id: j for d in found if d.agent_name == agent_name for j in d.state.jobs}


def just_started(job: api.Job, now: float) -> bool:
    """Whether the server started (or assigned) `job` within JOIN_S of `now` (wall time)."""
    started = job.state.started_at or job.state.updated_at  # nanoseconds
    return not started or now - started / 1e9 < JOIN_S


async def job_in_room(lk: LiveKit, room: str, agent_name: str, job: str) -> bool:
    """A job's look at another job whose mark holds its room: whether LiveKit agrees that one serves it (its
    agent in the room, or the server started it within JOIN_S)."""
    people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room))
    if agent_identity(job) in agents_in_room(people.participants):
        return True
    jobs = await room_jobs(lk, room, agent_name)
    return job in jobs and just_started(jobs[job], time.time())


async def room_name(lk: LiveKit, sid: str) -> str | None:
    """The name of the room `sid` (None: the server holds no such room)."""
    rooms = await lk.call(lk.api.room.list_rooms, api.ListRoomsRequest())
    return next((r.name for r in rooms.rooms if r.sid == sid), None)


class Agreement:
    """A worker's sweep's view of what LiveKit agrees with: the live marks it saw agreed with (by room sid),
    when it first saw each mark, and the rooms whose marks it warned of."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self._agreed: dict[str, str] = {}  # room sid -> the live mark whose agent was seen in it
        self._first: dict[str, tuple[str, float]] = {}  # room sid -> (its live mark, first seen, monotonic)
        self._warned: set[str] = set()  # room sids
        self._forged: dict[str, float] = {}  # room sid -> when a mark LiveKit disagreed with was last seen

    def known(self, sid: str, mark: str) -> bool:
        """Whether the room's live mark `mark` was agreed with (its agent seen in the room), or is new enough
        to be believed without a look (JOIN_S)."""
        if self._agreed.get(sid) == mark:
            return True
        first = self._first.get(sid)
        if first is None or first[0] != mark:
            self._first[sid] = first = (mark, time.monotonic())
        return time.monotonic() - first[1] < JOIN_S

    def holds(self, room: api.Room, mark: str, job: str, down: str | None, people, since: int) -> bool:
        """Whether a live mark naming `job` (its worker alive) holds the room as LiveKit sees it (`people`):
        its agent is in it, or the mark is new (JOIN_S); a down mark naming the job counts only while its
        agent is not in it. Else the mark is not believed, and said once per room."""
        present = agent_identity(job) in agents_in_room(people, since)
        if job == down:
            if present:
                self._warn(room, "a down mark names a job whose agent is in the room")
            return present
        if present:
            self._agreed[room.sid] = mark
            return True
        if self.known(room.sid, mark):
            return True
        self._warn(room, "a live mark names a job whose agent is not in the room")
        return False

    def saw_forged(self, sid: str) -> None:
        """A mark of the room LiveKit disagrees with was seen now."""
        self._forged[sid] = time.monotonic()

    def forged_lately(self, sid: str) -> bool:
        """Whether a mark of the room was seen within FORGED_S that LiveKit disagreed with: whoever wrote it
        may have removed it too, so the room's missing mark is asked of LiveKit as well."""
        return time.monotonic() - self._forged.get(sid, -FORGED_S) < FORGED_S

    async def served(self, lk: LiveKit, room: api.Room, people, since: int) -> bool:
        """Whether an agent of one of the room's jobs of this agent name is in it, as LiveKit lists them."""
        present = agents_in_room(people, since)
        if not present:
            return False
        jobs = await room_jobs(lk, room.name, self.agent_name)
        return any(agent_identity(j) in present for j in jobs)

    def _warn(self, room: api.Room, what: str) -> None:
        if room.sid not in self._warned:
            self._warned.add(room.sid)
            log.warning("room %s: %s; not believed", pseudonym("room", room.name), what)

    def forget(self, listed: set[str]) -> None:
        """Rooms no longer listed are forgotten."""
        self._agreed = {k: v for k, v in self._agreed.items() if k in listed}
        self._first = {k: v for k, v in self._first.items() if k in listed}
        self._warned &= listed
        self._forged = {k: v for k, v in self._forged.items() if k in listed}
