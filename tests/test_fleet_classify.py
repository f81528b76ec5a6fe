"""The fleet's verdict on a room (agent/fleet/classify.py), as a table: for each fault the fleet's tests meet
(a worker killed or hung, an engine killed, a job's connection down, a drain and its handovers, forged marks,
a room made again on another node, a caller gone, a call ended, a first dispatch that found no worker) and
the races between them, what was read (marks, presence, participants, dispatches, the time) and the verdict:
alone and why, over, a job taken down, and which reads the verdict needed (a room held needs no API call).
Then sweeps in a row, the memory carried from one to the next.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from livekit import api

from agent.fleet import timing
from agent.fleet.classify import Memory, Need, Seen, Verdict, classify
from agent.fleet.state import Reason, RoomState

NOW = 1000.0  # monotonic
WALL = 1_800_000_000.0  # wall time, as participants' joined_at
LOST, NEVER, HANDED = Reason.AGENT_LOST, Reason.NEVER_ANSWERED, Reason.HANDED_OVER
P, O, J = Need.PARTICIPANTS, Need.OURS, Need.JOBS
K = api.ParticipantInfo.Kind


def person(identity: str, kind=K.STANDARD, joined: float = WALL - 60, state=api.ParticipantInfo.State.ACTIVE):
    return api.ParticipantInfo(identity=identity, kind=kind, state=state, joined_at=int(joined))


CALLER = person("caller")
PHONE = person("phone", K.SIP)
JOINING = person("caller", state=api.ParticipantInfo.State.JOINING)
EGRESS = person("recorder", K.EGRESS)


def agent(job: str, joined: float = WALL - 60) -> api.ParticipantInfo:
    return person(f"agent-{job}", K.AGENT, joined)


def run(
    state: RoomState,
    *,
    gone: tuple[str, ...] = (),
    people: tuple[api.ParticipantInfo, ...] = (CALLER,),
    ours: bool = True,
    jobs: tuple[str, ...] = (),
    memory: Memory | None = None,
    now: float = NOW,
    wall: float = WALL,
) -> tuple[Verdict, list[Need]]:
    """The verdict, reading what it needs as the sweep does (each at most once), and the reads it needed."""
    seen, memory = Seen(state, frozenset(gone)), memory or Memory()
    reads: list[Need] = []
    while (v := classify(seen, memory, now, wall)).need is not None:
        assert v.need not in reads, f"{v.need} read twice"
        reads.append(v.need)
        if v.need is Need.PARTICIPANTS:
            seen = replace(seen, people=people)
        else:
            seen = replace(seen, ours=ours, jobs=frozenset(jobs))
    return v, reads


LIVE = "w-a AJ_1"  # the live mark of job AJ_1, run by worker w-a
AGREED = Memory(agreed=LIVE, agreed_at=NOW - 1)  # its agent was seen in the room a second ago
LATE = Memory(first=("w-x AJ_made_up", NOW - timing.JOIN_S - 1))  # a mark first seen longer than JOIN_S ago
MOVING = Memory(node="ND_live", moved_at=NOW - 1)  # made again on ND_live a second ago
FORGED_LATELY = Memory(forged_at=NOW - 1)

# (case, state, context, why, reads, and what else the verdict says)
CASES = [
    # -- a room served as it should be
    ("held: its agent seen in it", RoomState(live=LIVE, served=True), dict(memory=AGREED), None, [], {}),
    ("held: a new job's mark, its agent joining", RoomState(live=LIVE, served=True), {}, None, [], {}),
    (
        "held: its agent in it, as LiveKit lists",
        RoomState(live=LIVE, served=True),
        dict(memory=replace(AGREED, agreed=None, first=(LIVE, NOW - 60)), people=(CALLER, agent("AJ_1"))),
        None,
        [P],
        {},
    ),
    # -- an agent lost
    (
        "worker killed: its presence connection gone",
        RoomState(live=LIVE, served=True),
        dict(gone=("w-a",)),
        LOST,
        [P],
        {},
    ),
    ("worker hung: its mark expired", RoomState(served=True), {}, LOST, [P], {}),
    ("engine killed: its job ended, the room unmarked", RoomState(served=True), {}, LOST, [P], {}),
    ("a job's connection down", RoomState(live=LIVE, served=True, down="AJ_1"), {}, LOST, [P], {}),
    ("a SIP caller counts as a caller", RoomState(served=True), dict(people=(PHONE,)), LOST, [P], {}),
    # -- a drain
    ("drained: handed over", RoomState(served=True, drained_by="w-old"), {}, HANDED, [P], {}),
    (
        "handover on its way",
        RoomState(served=True, drained_by="w-old", handover_asked=True),
        {},
        None,
        [],
        dict(on_its_way=True),
    ),
    (
        "handover asked, its drainer died",
        RoomState(served=True, drained_by="w-old", handover_asked=True),
        dict(gone=("w-old",)),
        LOST,
        [P],
        {},
    ),
    (
        "drained, its drainer died before its turn",
        RoomState(served=True, drained_by="w-old"),
        dict(gone=("w-old",)),
        LOST,
        [P],
        {},
    ),
    # -- forged marks
    (
        "forged live mark, the room's agent in it",
        RoomState(live="w-x AJ_made_up", served=True),
        dict(memory=LATE, people=(CALLER, agent("AJ_1")), jobs=("AJ_1",)),
        None,
        [P, J],
        dict(warn="a live mark names a job whose agent is not in the room"),
    ),
    (
        "forged live mark, no agent in the room",
        RoomState(live="w-x AJ_made_up", served=True),
        dict(memory=LATE, jobs=("AJ_1",)),
        LOST,
        [P],
        dict(warn="a live mark names a job whose agent is not in the room"),
    ),
    (
        "forged live mark, new: believed for JOIN_S",
        RoomState(live="w-x AJ_made_up", served=True),
        {},
        None,
        [],
        {},
    ),
    (
        "forged down mark, its agent in the room",
        RoomState(served=True, down="AJ_1"),
        dict(people=(CALLER, agent("AJ_1")), jobs=("AJ_1",)),
        None,
        [P, J],
        dict(warn="a down mark names a job whose agent is in the room"),
    ),
    (
        "forged down mark on a live one, its agent in it",
        RoomState(live=LIVE, served=True, down="AJ_1"),
        dict(people=(CALLER, agent("AJ_1"))),
        None,
        [P],
        dict(warn="a down mark names a job whose agent is in the room"),
    ),
    (
        "forged mark removed, the room's agent in it",
        RoomState(served=True),
        dict(memory=FORGED_LATELY, people=(CALLER, agent("AJ_1")), jobs=("AJ_1",)),
        None,
        [P, J],
        {},
    ),
    (
        "forged mark removed long ago: lost",
        RoomState(served=True),
        dict(
            memory=Memory(forged_at=NOW - timing.FORGED_S - 1), people=(CALLER, agent("AJ_1")), jobs=("AJ_1",)
        ),
        LOST,
        [P],
        {},
    ),
    (
        "an agent not of the room's jobs is no agent",
        RoomState(served=True, down="AJ_1"),
        dict(people=(CALLER, agent("AJ_other")), jobs=("AJ_1",)),
        LOST,
        [P],
        {},
    ),
    # -- a room made again on another node
    (
        "moved: seen on a new node, its agent not back yet",
        RoomState(live=LIVE, served=True, node="ND_live"),
        dict(memory=replace(AGREED, node="ND_dead")),
        None,
        [P],
        dict(moved=True),
    ),
    (
        "moved: its agent not back for ABSENT_S",
        RoomState(live=LIVE, served=True, node="ND_live"),
        dict(memory=replace(AGREED, node="ND_live", moved_at=NOW - 2, absent_since=NOW - timing.ABSENT_S)),
        LOST,
        [P],
        dict(take_down="AJ_1"),
    ),
    (
        "moved: its agent joined again",
        RoomState(live=LIVE, served=True, node="ND_live"),
        dict(memory=replace(MOVING, agreed=LIVE, absent_since=NOW - 9), people=(CALLER, agent("AJ_1", WALL))),
        None,
        [P],
        {},
    ),
    (
        "moved: the dead node's agent, listed from before, is not back",
        RoomState(live=LIVE, served=True, node="ND_live"),
        dict(
            memory=replace(MOVING, agreed=LIVE, absent_since=NOW - 9),
            people=(person("caller", joined=WALL - 1), agent("AJ_1", WALL - 60)),
        ),
        LOST,
        [P],
        dict(take_down="AJ_1"),
    ),
    (
        "moved and down: the dead node's agent does not hold it",
        RoomState(live=LIVE, served=True, down="AJ_1", node="ND_live"),
        dict(memory=MOVING, people=(person("caller", joined=WALL - 1), agent("AJ_1", WALL - 60))),
        LOST,
        [P],
        {},
    ),
    (
        "moved long ago: a room like any",
        RoomState(live=LIVE, served=True, node="ND_live"),
        dict(memory=replace(AGREED, node="ND_live", moved_at=NOW - timing.MOVED_S)),
        None,
        [],
        {},
    ),
    # -- the caller gone, the call ended
    (
        "caller gone, agent lost, OVER_S ago: over",
        RoomState(served=True),
        dict(people=(), memory=Memory(empty_since=NOW - timing.OVER_S)),
        None,
        [P],
        dict(over=True),
    ),
    ("caller gone, agent lost, just now", RoomState(served=True), dict(people=()), None, [P], {}),
    (
        "callers not back yet in a room made again: not over",
        RoomState(served=True, node="ND_live"),
        dict(people=(), memory=replace(MOVING, empty_since=NOW - timing.OVER_S)),
        None,
        [P],
        {},
    ),
    (
        "caller gone, its agent in the room: not over",
        RoomState(live=LIVE, served=True),
        dict(
            people=(agent("AJ_1"),), memory=Memory(agreed=None, first=(LIVE, NOW - 60), empty_since=NOW - 60)
        ),
        None,
        [P],
        {},
    ),
    ("only a recorder in the room: no caller", RoomState(served=True), dict(people=(EGRESS,)), None, [P], {}),
    ("a caller still joining is not one yet", RoomState(served=True), dict(people=(JOINING,)), None, [P], {}),
    ("call ended on purpose (room closed, goodbye)", RoomState(served=True, ended=True), {}, None, [], {}),
    (
        "call ended, though its worker died",
        RoomState(live=LIVE, served=True, ended=True),
        dict(gone=("w-a",)),
        None,
        [],
        {},
    ),
    # -- a first agent
    ("first dispatch found no worker", RoomState(), {}, NEVER, [O, P], {}),
    (
        "first dispatch still in its time",
        RoomState(),
        dict(people=(person("caller", joined=WALL - 1),)),
        None,
        [O, P],
        {},
    ),
    ("another agent's room", RoomState(), dict(ours=False), None, [O], {}),
    ("a room of ours with no caller yet", RoomState(), dict(people=()), None, [O, P], {}),
]


@pytest.mark.parametrize(
    ("state", "context", "why", "reads", "more"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_rooms_verdict(state, context, why, reads, more):
    v, read = run(state, **context)
    assert (v.why, read) == (why, reads)
    assert v.over == more.get("over", False)
    assert v.take_down == more.get("take_down")
    assert v.on_its_way == more.get("on_its_way", False)
    assert v.moved == more.get("moved", False)
    assert v.warn == more.get("warn")


def test_a_verdict_is_the_same_for_the_same_reads_and_changes_nothing_it_was_given():
    memory = Memory(node="ND_dead", empty_since=NOW - 1)
    state = RoomState(live=LIVE, served=True, node="ND_live")
    first, second = run(state, memory=memory), run(state, memory=memory)
    assert first == second and memory == Memory(node="ND_dead", empty_since=NOW - 1)


def test_a_call_is_over_only_once_its_caller_was_gone_for_over_s_without_a_break():
    served = RoomState(served=True)
    v, _ = run(served, people=())  # the caller hung up in the silence
    at = v.memory.empty_since
    v, _ = run(served, people=(), memory=v.memory, now=NOW + timing.OVER_S / 2)
    assert (v.over, v.memory.empty_since) == (False, at)
    v, _ = run(served, memory=v.memory, now=NOW + timing.OVER_S / 2 + 1)  # back before it was over
    assert (v.why, v.memory.empty_since) == (LOST, None)
    v, _ = run(served, people=(), memory=v.memory, now=NOW + timing.OVER_S + 1)
    assert not v.over  # gone again: counted from now
    v, _ = run(served, people=(), memory=v.memory, now=NOW + 2 * timing.OVER_S + 1)
    assert v.over and v.memory.empty_since is None


def test_a_mark_whose_agent_never_comes_holds_its_room_for_join_s_then_is_said_once_and_not_believed():
    made_up = RoomState(live="w-x AJ_made_up", served=True)
    seen = []
    memory = Memory()
    for t in (0.0, timing.JOIN_S - 0.1, timing.JOIN_S, timing.JOIN_S + 1):
        v, reads = run(made_up, memory=memory, now=NOW + t)
        memory = v.memory
        seen.append((v.why, v.warn is not None, reads))
    assert seen == [(None, False, []), (None, False, []), (LOST, True, [P]), (LOST, False, [P])]


def test_a_moved_room_whose_agent_stays_away_is_lost_after_absent_s_and_its_job_taken_down():
    state = RoomState(live=LIVE, served=True, node="ND_live")
    memory = replace(AGREED, node="ND_dead")
    back = (
        person("caller", joined=WALL - 1),
        agent("AJ_1", WALL - 60),
    )  # its agent listed from the dead node
    out = []
    for t in (0.0, timing.ABSENT_S / 2, timing.ABSENT_S):
        v, _ = run(state, memory=memory, people=back, now=NOW + t)
        memory = v.memory
        out.append((v.why, v.take_down, v.moved))
    assert out == [(None, None, True), (None, None, False), (LOST, "AJ_1", False)]
    # settled on its new node, its agent in it
    v, _ = run(state, memory=memory, people=(CALLER, agent("AJ_1", WALL)), now=NOW + timing.MOVED_S + 1)
    assert (v.why, v.take_down) == (None, None)


def test_a_held_rooms_mark_is_looked_at_again_after_agreed_s_and_its_caller_found_alone_once_its_agent_left():
    """A job its worker still lists whose agent left the room with no down mark (its process ending after
    its connection was lost): the mark holds the room without a read for AGREED_S after its agent was last
    seen in it, then LiveKit's list is read again; the agent gone, the caller is alone."""
    held = RoomState(live=LIVE, served=True)
    memory = replace(AGREED, agreed_at=NOW)
    out = []
    for t, people in (
        (timing.AGREED_S - 0.1, (CALLER,)),  # (its agent left meanwhile: not read yet)
        (timing.AGREED_S, (CALLER, agent("AJ_1"))),  # looked at again: still there
        (timing.AGREED_S + 1, (CALLER,)),
        (2 * timing.AGREED_S, (CALLER,)),
    ):
        v, reads = run(held, people=people, memory=memory, now=NOW + t)
        memory = v.memory
        out.append((v.why, reads, v.memory.agreed_at - NOW))
    assert out == [
        (None, [], 0.0),
        (None, [P], timing.AGREED_S),
        (None, [], timing.AGREED_S),
        (LOST, [P], timing.AGREED_S),
    ]
