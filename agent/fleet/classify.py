"""The fleet's verdict on one room (agent/fleet/fleet.py), as one pure function: `classify(seen, memory, now,
wall)` takes what a sweep read of the room (its marks, which workers are gone, and, where the verdict needs
them, its participants and dispatches) with what the worker's sweeps remember of it, and gives a `Verdict`:
whether the room is alone and why, what to read first if more is needed, what to do (a job taken as down,
the call over), and what to remember. No I/O, no clock: the same reads give the same verdict.

A room is:
- **closed to the fleet** when its call ended on purpose, or a handover asked for is on its way (its
  draining worker alive);
- **held** while its live mark (of a worker not gone, a job not down) is believed: LiveKit lists the job's
  agent in the room (looked at again every AGREED_S: a job its worker still lists may have left the room
  without a down mark, its process ending after its connection was lost, or hung), or the mark is younger
  than JOIN_S;
- **not ours** when it was never served and has no dispatch of this agent;
- **over** when it was served, has no agent, and no caller has been in it for OVER_S;
- **alone** (`Reason`) when a caller is in it and no agent serves it: served and lost (AGENT_LOST), served
  and drained (HANDED_OVER), or never served and its caller waited FIRST_AGENT_S (NEVER_ANSWERED); a room
  made again on another node within MOVED_S whose agent has not joined it again for ABSENT_S is alone
  though its mark is live (its job is taken as down).
A mark LiveKit does not agree with (a forged one) neither holds a room nor, while an agent of one of the
room's jobs is in it, leaves it alone. Knows LiveKit's participant kinds; nothing of Redis or the API.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from livekit import api

from agent.fleet import timing
from agent.fleet.agreed import AGENT, agent_identity, agents_in_room
from agent.fleet.state import Reason, RoomState, callers


class Need(enum.Enum):
    """What a verdict needs read before it can be given."""

    OURS = "whether the room has a dispatch of this agent"  # (a room found not ours lately: no)
    JOBS = "the jobs of the room's dispatches of this agent"
    PARTICIPANTS = "the room's participants"


@dataclass(frozen=True)
class Seen:
    """What a sweep read of one room; None: not read (yet)."""

    state: RoomState
    gone: frozenset[str] = frozenset()  # the workers whose presence connection is gone
    people: tuple[api.ParticipantInfo, ...] | None = None
    ours: bool | None = None  # the room has a dispatch of this agent
    jobs: frozenset[str] | None = None  # the ids of the jobs of the room's dispatches of this agent


@dataclass(frozen=True)
class Memory:
    """What a worker's sweeps remember of one room (times are monotonic seconds)."""

    node: str | None = None  # the node last seen hosting it
    moved_at: float = -math.inf  # when it was seen made again on that node (-inf: never seen moving)
    absent_since: float | None = None  # moved, and its agent not in it since
    empty_since: float | None = None  # served, no agent, and no caller in it since
    agreed: str | None = None  # the live mark whose job's agent was seen in the room
    agreed_at: float = -math.inf  # when it was last seen there
    first: tuple[str, float] | None = None  # (the live mark, when first seen)
    forged_at: float = -math.inf  # when a mark LiveKit disagreed with was last seen
    warned: bool = False  # a mark LiveKit disagreed with was said


@dataclass(frozen=True)
class Verdict:
    """A room's verdict: `why` it is alone (None: it is not), or what it `need`s read first."""

    memory: Memory
    why: Reason | None = None
    need: Need | None = None
    over: bool = False  # its call is over: it is no longer served
    take_down: str | None = None  # a job to mark down (a moved room's, its agent not in it)
    on_its_way: bool = False  # a handover asked for is on its way
    moved: bool = False  # seen made again on another node in this sweep (said)
    warn: str | None = None  # a mark LiveKit does not agree with (said once per room)


def classify(seen: Seen, memory: Memory, now: float, wall: float) -> Verdict:
    """The room's verdict from what was read (`seen`) and remembered (`memory`), at `now` (monotonic) and
    `wall` (wall time, as participants' `joined_at` is)."""
    s, gone = seen.state, seen.gone
    live = s.live is not None and s.worker not in gone  # as the marks tell; LiveKit agrees below
    mem, moved, moved_now = _moved(memory, s.node, now)
    on_its_way = s.handover_asked and s.drained_by not in (None, *gone)
    base = Verdict(mem, on_its_way=on_its_way, moved=moved_now)
    if s.ended or on_its_way:
        return base
    if live and not moved and s.job != s.down:
        mem, known = _known(mem, s.live, now)
        if known:
            return replace(base, memory=mem)
    if not (s.served or live):
        if seen.ours is None:
            return replace(base, need=Need.OURS)
        if not seen.ours:
            return replace(base, memory=mem)
    if seen.people is None:
        return replace(base, need=Need.PARTICIPANTS)
    people, present = seen.people, callers(seen.people)
    # a room made again on another node lists the dead node's agent from before its callers came back
    since = min(p.joined_at for p in present) if mem.moved_at > -math.inf and present else 0
    forged, warn = False, None  # a mark LiveKit does not agree with: a down job's agent in the room, say
    if live:
        mem, live, warn = _holds(mem, s.live, s.job, s.down, people, since, now, fresh=not moved)
        forged = not live and s.job != s.down
    elif s.live is None and s.down is not None:
        mem, forged, warn = _holds(mem, s.down, s.down, s.down, people, since, now, fresh=not moved)
    if forged:
        mem = replace(mem, forged_at=now)
    elif s.live is None and s.down is None and s.served:
        forged = now - mem.forged_at < timing.FORGED_S  # removed by whoever wrote it, or by its job
    base = replace(base, warn=warn)
    if not present:
        # its agent lost and its caller gone (hung up in the silence): nobody ends the call on purpose
        if s.served and not live and not moved:
            empty = now if mem.empty_since is None else mem.empty_since
            if now - empty >= timing.OVER_S:
                return replace(base, memory=replace(mem, empty_since=None), over=True)
            mem = replace(mem, empty_since=empty)
        return replace(base, memory=mem)
    mem = replace(mem, empty_since=None)
    if forged and (agents := agents_in_room(people, since)):
        if seen.jobs is None:
            return replace(base, need=Need.JOBS)
        if any(agent_identity(j) in agents for j in seen.jobs):
            return replace(base, memory=mem)  # LiveKit lists an agent of one of the room's jobs in it
    if live and not moved:
        return replace(base, memory=mem)
    if live:  # made again on another node: is its agent in it, or still on the node that died?
        # (the server lists the participants its nodes stored in Redis: a dead node's agent stays listed,
        # joined before the callers came back to the room made again)
        back_at = min(p.joined_at for p in present)
        if any(p.kind == AGENT and p.joined_at >= back_at for p in people):
            return replace(base, memory=replace(mem, absent_since=None))
        absent = now if mem.absent_since is None else mem.absent_since
        mem = replace(mem, absent_since=absent)
        if now - absent >= timing.ABSENT_S:  # its job, up as far as it knows, is taken as down
            return replace(base, memory=mem, why=Reason.AGENT_LOST, take_down=s.job)
        return replace(base, memory=mem)
    if s.served:  # handed over while its draining agent talks on (else lost: its worker died meanwhile)
        drained = s.drained_by is not None and s.drained_by not in gone
        return replace(base, memory=mem, why=Reason.HANDED_OVER if drained else Reason.AGENT_LOST)
    if wall - min(p.joined_at for p in present) >= timing.FIRST_AGENT_S:
        return replace(base, memory=mem, why=Reason.NEVER_ANSWERED)
    return replace(base, memory=mem)


def _moved(mem: Memory, node: str | None, now: float) -> tuple[Memory, bool, bool]:
    """The memory, whether the room moved to another node (LiveKit's room_node_map) within MOVED_S, and
    whether it was seen moving just now."""
    if node is None:
        return mem, False, False
    if mem.node is None:
        return replace(mem, node=node), False, False
    if mem.node != node:
        return replace(mem, node=node, moved_at=now), True, True
    return mem, now - mem.moved_at < timing.MOVED_S, False


def _known(mem: Memory, mark: str, now: float, fresh: bool = True) -> tuple[Memory, bool]:
    """Whether the live mark `mark` was agreed with (its agent seen in the room; with `fresh`, within
    AGREED_S), or is new enough to be believed without a look (JOIN_S). A mark agreed with longer ago is not
    new: it is looked at again. (A moved room's agent is looked for apart: its mark holds while it moves.)"""
    if mem.agreed == mark:
        return mem, not fresh or now - mem.agreed_at < timing.AGREED_S
    if mem.first is None or mem.first[0] != mark:
        mem = replace(mem, first=(mark, now))
    assert mem.first is not None
    return mem, now - mem.first[1] < timing.JOIN_S


def _holds(
    mem: Memory, mark: str, job: str | None, down: str | None, people, since: int, now: float, fresh: bool
) -> tuple[Memory, bool, str | None]:
    """Whether a mark naming `job` holds the room as LiveKit lists it (`people`): a live mark while its agent
    is in it, or while the mark is new (JOIN_S); a down mark (`job` == `down`) only while its agent is not.
    With what to say, once per room, of a mark not believed."""
    present = job is not None and agent_identity(job) in agents_in_room(people, since)
    if job == down:
        mem, warn = _warned(mem, "a down mark names a job whose agent is in the room", present)
        return mem, present, warn
    if present:
        return replace(mem, agreed=mark, agreed_at=now), True, None
    mem, known = _known(mem, mark, now, fresh)
    if known:
        return mem, True, None
    mem, warn = _warned(mem, "a live mark names a job whose agent is not in the room", True)
    return mem, False, warn


def _warned(mem: Memory, what: str, say: bool) -> tuple[Memory, str | None]:
    if not say or mem.warned:
        return mem, None
    return replace(mem, warned=True), what
