"""A room as the fleet sees it (agent/fleet/fleet.py), as types: why a room is alone (`Reason`), who counts
as its caller (`callers`), and its marks in the cluster's Redis, read and decoded by name (`RoomState`,
`queue_reads`, `decode`). Knows the marks' keys (agent/fleet/marks.py) and LiveKit's participant kinds;
nothing of the engine or the call.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from livekit import api

from agent.fleet.marks import _job, _owner, _text

if TYPE_CHECKING:
    from agent.fleet.marks import Keys

NODE_MAP = "room_node_map"  # LiveKit's own, in a cluster's Redis: room name -> the node that hosts the room
REDISPATCH_KEY = "chorus_redispatched"  # in a dispatch's metadata: how often its room's agent was replaced
REASON_KEY = "chorus_reason"  # ... and why, this time (a `Reason`'s value)


class Reason(enum.StrEnum):
    """Why a room is alone, and so why its new agent was dispatched (in its metadata, under REASON_KEY, and
    in the snapshot's `redispatches` and /metrics' `chorus_redispatches_total{reason}`)."""

    AGENT_LOST = "agent lost"  # it had an agent, and lost it (its worker, engine, node or connection died)
    NEVER_ANSWERED = "never answered"  # its caller waited FIRST_AGENT_S for the server's own dispatch
    HANDED_OVER = "handed over"  # its worker drains (a rolling restart): its call goes to another worker


# a caller: a standard (a browser, an app) or SIP (a phone) participant, joined or active. The kinds' values
# are the rtc SDK's `ParticipantKind`'s too (agent/room.py waits for one with them)
CALLER_KINDS = (api.ParticipantInfo.Kind.STANDARD, api.ParticipantInfo.Kind.SIP)
PRESENT = (api.ParticipantInfo.State.JOINED, api.ParticipantInfo.State.ACTIVE)


def callers(people: Iterable[api.ParticipantInfo]) -> list[api.ParticipantInfo]:
    """The room's callers among the participants LiveKit lists."""
    return [p for p in people if p.kind in CALLER_KINDS and p.state in PRESENT]


@dataclass(frozen=True)
class RoomState:
    """One room's marks as a sweep reads them (agent/fleet/fleet.py says what each means)."""

    live: str | None = None  # the live mark, "<worker> <job>" (None: none)
    served: bool = False  # the room has had an agent
    ended: bool = False  # its call ended on purpose
    drained_by: str | None = None  # the draining worker that hands the room over (its `drained` mark)
    handover_asked: bool = False  # a handover was asked for and is on its way
    down: str | None = None  # the job marked down in it
    node: str | None = None  # the LiveKit node that hosts it (LiveKit's room_node_map)

    @property
    def worker(self) -> str | None:
        """The worker the live mark names."""
        return _owner(self.live)

    @property
    def job(self) -> str | None:
        """The job the live mark names."""
        return _job(self.live)


READS = len(fields(RoomState))  # the answers read for each room


def queue_reads(p: Any, keys: Keys, room: api.Room) -> None:
    """Queue on the pipeline `p` the reads of one room's marks, in `RoomState`'s order."""
    p.get(keys.live(room.sid))
    p.exists(keys.served(room.sid))
    p.exists(keys.ended(room.sid))
    p.get(keys.drained(room.sid))
    p.exists(keys.handover_asked(room.sid))
    p.get(keys.down(room.sid))
    p.hget(NODE_MAP, room.name)


def decode(answers: Sequence[Any]) -> list[RoomState]:
    """The rooms' states from the pipeline's answers to `queue_reads`, room after room."""
    out = []
    for i in range(0, len(answers), READS):
        live, served, ended, drained_by, asked, down, node = answers[i : i + READS]
        out.append(
            RoomState(
                live=_text(live),
                served=bool(served),
                ended=bool(ended),
                drained_by=_text(drained_by),
                handover_asked=bool(asked),
                down=_text(down),
                node=_text(node),
            )
        )
    return out
