"""No caller left alone: every worker marks the rooms its calls serve in the LiveKit cluster's own Redis, and
watches every room of the server for a caller with no live agent, for whom it asks the server for a new
dispatch of the agent. LiveKit's open-source server dispatches a room's agent once, when the room starts: a
worker killed, an engine that died under its worker, a room's job that crashed, a dispatch that timed out or
found no worker, each leaves its caller in silence until they hang up.

- **Live.** Every BEAT_S each worker sets `chorus:<agent>:live:<room sid>` (expiring after LIVE_MS) for each
  job it runs, naming itself and the job, and `...:served:<room sid>` (the room has had an agent: its loss is
  acted on at once). A job that ends is unmarked at the next beat. A worker also holds a connection of its
  own to Redis, named after it (`chorus-<agent>-<worker>`): a worker whose process dies loses it at once (its
  host's kernel closes it), and the rooms it marked are alone from the second sweep that finds its name gone
  from Redis' client list, without waiting for their marks to expire. A worker that hangs, or whose host
  vanishes, stops marking, and its rooms' marks expire.
- **Down.** A job whose own connection to its room has been down DOWN_GRACE_S (the rtc SDK reconnecting:
  its LiveKit node died, its host lost the network) sets `...:down:<room sid>` to its job id while it lasts:
  its worker's mark no longer counts, and the room is alone. When the connection is back and another job has
  marked the room meanwhile, this one leaves: the room has its new agent (`watch_link`).
- **Believed.** A mark is anyone's to write who can write to Redis, while only the server puts an agent in a
  room: a live mark counts while LiveKit lists its job's agent in the room (or for its first JOIN_S), a down
  mark only while LiveKit does not, and a room whose live mark names a job LiveKit does not know is its
  agent's still while an agent of one of the room's jobs is in it (agent/fleet/agreed.py). So a mark forged
  by hand neither makes a call's agent leave nor swaps it.
- **Alone.** Every SWEEP_S each worker lists the server's rooms; a room of this agent (served, or with a
  dispatch of its name) with no live mark (or the mark of a job that is down) and a caller (a standard or SIP
  participant) is alone if it was served, or if its caller has waited FIRST_AGENT_S for the server's own
  dispatch.
- **Moved.** A room whose node died is made again on another node when its caller's SDK reconnects (the
  servers' own `room_node_map` in Redis names the new node), while its agent's SDK may take seconds more to
  find its connection dead. For MOVED_S after a room's node changed, the watch looks into it: a caller there
  and no agent for ABSENT_S, it is alone though its mark is live.
- **Held.** A room made again on another node after its node died keeps its sid (the cluster's Redis holds
  it), and the server dispatches its agent again; so may a dispatch race a rejoining agent. A new job whose
  room is marked by another job that is up, of a worker alive, leaves at once (`holder`): one agent per
  room.
- **Handed over.** A worker that drains (SIGTERM: a rolling restart) stops marking its rooms and marks each
  `...:handover:<room sid>`: they are alone at the next sweep, and the new agent in each takes the call over
  from the draining one, which talks on until the new one's session is live and then is removed by it. With
  no other worker to take them, its calls end as a drain's do (agent/fleet/drain.py). They are handed over
  HANDOVERS_AT_ONCE at a time (the same rooms in every worker's sweep, the lowest sids): a handover asked
  for marks the room `...:handing:<room sid>` until its new agent marks it (HANDING_MS at most, and only
  while the draining worker lives), and such a room is not alone meanwhile.
- **Over.** A served room with no live agent whose caller has been gone OVER_S (they hung up before a new
  agent came) is no longer served, and the worker that found it deletes its conversation (`watch`'s `over`):
  no job is left to end that call on purpose.
- **Ended.** A call that ends on purpose (its caller left or was said goodbye to, transferred, hung up)
  marks its room `...:ended:<room sid>`: a caller still in it is not sent another agent.
- **One new agent.** Of the workers that find a room alone, the one that sets `...:claim:<room sid>` first
  (SET NX, expiring after CLAIM_MS) asks for the dispatch; the others leave it. It looks at the room's marks
  once more first: a look waits on LiveKit's API (seconds, on a busy server), and a room that a new job
  marked, or whose call ended, meanwhile is left. A dispatch that brings no agent in that time is asked for
  again. Of two jobs one worker runs for one room, the oldest that is not down is marked (as across workers
  the one marked first keeps it). The new job removes the agents left in the room from before
  (`remove_stale_agents`), so no two answer the caller.

Each new dispatch is counted (handed to the engine through its door: `redispatches` in the snapshot and on
the monitoring page, `chorus_redispatches_total{reason}` on /metrics) and logged with the room's
pseudonym, never its name. A worker's part is `Fleet`, here, which its watch runs
(agent/fleet/worker_watch.py); a room's job's part is agent/fleet/room_job.py; the marks' keys and scripts are
agent/fleet/marks.py. Knows LiveKit's room and dispatch API and Redis; nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from livekit import api

from agent.fleet.agreed import Agreement
from agent.fleet.dispatches import last_metadata
from agent.fleet.gone import GONE_S as GONE_S  # (the fleet's timings, in one place)
from agent.fleet.gone import Presences
from agent.fleet.marks import _MARK, _UNMARK, Keys, _job, _owner, _text, one_per_room
from agent.lkapi import LiveKitFailure
from redaction import pseudonym

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from agent.lkapi import LiveKit

log = logging.getLogger("chorus.agent.fleet")

BEAT_S = 0.5  # how often a worker marks its rooms live
# a mark not renewed this long is a hung worker's (a dead one's process is found by its presence connection
# at once): long enough for a worker whose loop or Redis stalls for seconds under load to renew it (at 2 s, a
# busy host's rooms were taken for lost and sent second agents)
LIVE_MS = 5000
SERVED_S = 3600  # how long a room is remembered to have had an agent, after its last mark
SWEEP_S = 0.5  # how often a worker looks for rooms alone
FIRST_AGENT_S = 5.0  # a caller who has waited this long for the room's first agent gets one asked for
OTHERS_S = 10.0  # a room dispatched no agent of this name is asked about again after this long
CLAIM_MS = 5000  # one new dispatch per room in this long, cluster-wide (a new job marks its room at launch)
ABSENT_S = 1.0  # a moved room's caller with no agent in the room this long is alone
N = 7  # the marks read for each room in a sweep
NODE_MAP = "room_node_map"  # LiveKit's own, in a cluster's Redis: room name -> the node that hosts the room
MOVED_S = 15.0  # a room made again on another node is looked into this long: is its agent in it?
MOVED_DOWN_MS = 10_000  # a moved room's agent, not in it, is taken as down this long (until replaced)
OVER_S = 5.0  # a served room with no agent and no caller this long: the call is over (its caller hung up)
REDISPATCH_KEY = "chorus_redispatched"  # in a dispatch's metadata: how often its room's agent was replaced
REASON_KEY = "chorus_reason"  # ... and why, this time

CALLER_KINDS = (api.ParticipantInfo.Kind.STANDARD, api.ParticipantInfo.Kind.SIP)
PRESENT = (api.ParticipantInfo.State.JOINED, api.ParticipantInfo.State.ACTIVE)

REASONS = ("agent lost", "never answered", "handed over")
HANDOVER_S = 60  # a room handed over is known as such this long (until its new agent marks it)
# a drain's calls are handed over this many at a time, cluster-wide as the sweeps see it: each new agent's
# start (a process, a connection, a prefill) is a burst of work on the host that takes it, and a host handed a
# whole worker's calls at once starves its own calls and its LiveKit server (seen: connections failing by
# the dozen)
HANDOVERS_AT_ONCE = 4
HANDING_MS = 30_000  # a handover asked for is waited for this long (the draining agent talks on meanwhile)


class Fleet:
    """One worker's part in the fleet: `beat(jobs)` marks the rooms of its running jobs (each a
    (room sid, job id)) and unmarks those that ended; `sweep(lk)` asks for a new agent for every room alone
    that it claims first. `counts` per reason, for the snapshot; `clock` is wall time (a participant's
    `joined_at` is)."""

    def __init__(
        self,
        redis: Redis,
        agent_name: str,
        worker: str,
        clock: Callable[[], float] = time.time,
        presence: Redis | None = None,
    ) -> None:
        self.redis, self.agent_name, self.worker, self.clock = redis, agent_name, worker, clock
        self.presence = presence  # this worker's named connection (None: its rooms are known by their marks)
        self.keys = Keys(agent_name)
        self.marked: dict[str, str] = {}  # room sid -> job id, as of the last beat
        self.counts = dict.fromkeys(REASONS, 0)
        self._others: dict[str, float] = {}  # room sid -> when it was last found another agent's
        self._nodes: dict[str, tuple[str, float]] = {}  # room sid -> (its node, when it moved there)
        self._absent: dict[str, float] = {}  # room sid (moved) -> since when its agent was not in it
        self._empty: dict[str, float] = {}  # room sid (served, agent lost) -> since when no caller was in it
        self.over: list[str] = []  # rooms whose call ended with no agent in them, since `sweep` last ran
        self.presences = Presences(redis, agent_name, worker)  # the other workers' presence connections
        self.handing_over = False  # the worker drains: its rooms go to other workers
        self._looked: dict[str, Any] = {}  # room sid -> its live mark when the last sweep found it alone
        self.handing = 0  # handovers asked for and on their way, as the last sweep found them
        self.agreed = Agreement(agent_name)  # the marks LiveKit agrees with (agent/fleet/agreed.py)

    def _mark(self, job: str) -> str:
        return f"{self.worker} {job}"

    async def beat(self, jobs: list[tuple[str, str]]) -> None:
        """Mark the rooms of `jobs` (room sid, job id; oldest first) live, and unmark those that ended."""
        if self.presence is not None:
            await self.presences.ping(self.presence)  # (re)opened before the marks
        now = await one_per_room(self.redis, self.keys, jobs)
        if self.handing_over:  # none of its rooms is marked live from now on
            async with self.redis.pipeline(transaction=False) as p:
                for sid in now:
                    p.set(self.keys.handover(sid), self.worker, ex=HANDOVER_S)
                await p.execute()
            now = {}
        order = list(now.items())
        marks: list[Any] = []
        if order:
            async with self.redis.pipeline(transaction=False) as p:
                for sid, job in order:
                    p.eval(_MARK, 2, self.keys.live(sid), self.keys.down(sid), self._mark(job), LIVE_MS, job)
                marks = await p.execute()
        # another job's mark where this worker has a job: that job's worker died (its mark not yet expired),
        # or two jobs were dispatched to one room (the one marked first keeps it, the other leaves)
        held = {sid: m for (sid, _job), m in zip(order, marks, strict=True) if isinstance(m, bytes | str)}
        gone = (
            await self.presences.gone({w for w in map(_owner, held.values()) if w}, at_once=True)
            if held
            else set()
        )
        async with self.redis.pipeline(transaction=False) as p:
            for sid, job in order:
                if sid in held and _owner(held[sid]) in gone:
                    p.set(self.keys.live(sid), self._mark(job), px=LIVE_MS)
                p.set(self.keys.served(sid), job, ex=SERVED_S)
                if sid not in self.marked:  # a new agent here: a handover, if it was one, is done
                    p.delete(self.keys.handover(sid), self.keys.handing(sid))
            for sid, job in self.marked.items():
                if now.get(sid) != job:
                    p.eval(_UNMARK, 1, self.keys.live(sid), self._mark(job))
            await p.execute()
        self.marked = now

    async def alone(self, lk: LiveKit) -> list[tuple[api.Room, str]]:
        """The rooms with a caller and no live agent of this agent name, and why each is alone."""
        # every room: a room's `num_participants` in the server's list lags its participants by seconds
        rooms = list((await lk.call(lk.api.room.list_rooms, api.ListRoomsRequest())).rooms)
        if not rooms:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for r in rooms:
                p.get(self.keys.live(r.sid))
                p.exists(self.keys.served(r.sid))
                p.exists(self.keys.ended(r.sid))
                p.get(self.keys.handover(r.sid))
                p.exists(self.keys.handing(r.sid))
                p.get(self.keys.down(r.sid))
                p.hget(NODE_MAP, r.name)
            marks = await p.execute()
        owners = [_owner(m) for m in marks[::N]]
        drainers = [_text(m) for m in marks[3::N]]  # the worker that hands each room over, if one does
        gone = await self.presences.gone({w for w in owners + drainers if w})
        now = time.monotonic()
        # a handover asked for and on its way, its draining agent still talking: not alone
        on_its_way = [bool(marks[N * i + 4]) and d not in (None, *gone) for i, d in enumerate(drainers)]
        self.handing = sum(on_its_way)

        async def look(i: int, room: api.Room) -> str | None:  # why the room is alone (None: it is not)
            mark, served, ended, handover, _handing, down, node = marks[N * i : N * i + N]
            job, down = _job(mark), _text(down)
            live = mark is not None and owners[i] not in gone  # as the marks tell; LiveKit agrees below
            moved = self._moved(room, _text(node), now)
            if ended or on_its_way[i]:
                return None
            if live and not moved and job != down and self.agreed.known(room.sid, _text(mark)):
                return None
            if not (served or live or await self._ours(lk, room)):
                return None
            people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room.name))
            callers = [p for p in people.participants if p.kind in CALLER_KINDS and p.state in PRESENT]
            # a room made again on another node lists the dead node's agent from before its callers came back
            remade = self._nodes.get(room.sid, (None, -math.inf))[1] > -math.inf
            since = min(p.joined_at for p in callers) if remade and callers else 0
            forged = False  # a mark LiveKit does not agree with: a down job's agent in the room, say
            if live:
                live = self.agreed.holds(room, _text(mark), job, down, people.participants, since)
                forged = not live and job != down
            elif mark is None and down is not None:
                forged = self.agreed.holds(room, down, down, down, people.participants, since)
            if forged:
                self.agreed.saw_forged(room.sid)
            elif mark is None and down is None and served:
                forged = self.agreed.forged_lately(room.sid)  # removed by whoever wrote it, or by its job
            if not callers:
                # its agent lost and its caller gone (hung up in the silence): nobody ends the call on purpose
                lost = served and not live and not moved
                if lost and now - self._empty.setdefault(room.sid, now) >= OVER_S:
                    self.over.append(room.sid)
                return None
            self._empty.pop(room.sid, None)
            if forged and await self.agreed.served(lk, room, people.participants, since):
                return None  # LiveKit lists an agent of one of the room's jobs in it
            if live and not moved:
                return None
            if live:  # made again on another node: is its agent in it, or still on the node that died?
                # (the server lists the participants its nodes stored in Redis: a dead node's agent stays
                # listed, joined before the callers came back to the room made again)
                back_at = min(p.joined_at for p in callers)
                agent = api.ParticipantInfo.Kind.AGENT
                if any(p.kind == agent and p.joined_at >= back_at for p in people.participants):
                    self._absent.pop(room.sid, None)
                elif now - self._absent.setdefault(room.sid, now) >= ABSENT_S:
                    # its job, up as far as it knows, is taken as down: a new agent takes the room over
                    await self.redis.set(self.keys.down(room.sid), _job(mark), px=MOVED_DOWN_MS)
                    return REASONS[0]
                return None
            if served:  # handed over while its draining agent talks on (else lost: its worker died meanwhile)
                return REASONS[2] if handover and drainers[i] not in gone else REASONS[0]
            if self.clock() - min(p.joined_at for p in callers) >= FIRST_AGENT_S:
                return REASONS[1]
            return None

        # each room on its own: one on a node that just died (its API calls wait for their timeout, or
        # fail) holds up none of the others
        found = await asyncio.gather(*(look(i, room) for i, room in enumerate(rooms)), return_exceptions=True)
        out = []
        self._looked = {}
        for i, (room, why) in enumerate(zip(rooms, found, strict=True)):
            if isinstance(why, LiveKitFailure):
                log.info("a room could not be looked at (%s)", why)
            elif isinstance(why, BaseException):
                raise why
            elif why is not None:
                out.append((room, why))
                self._looked[room.sid] = marks[N * i]
        listed = {r.sid for r in rooms}
        if len(self._nodes) > len(listed):  # rooms gone
            self._nodes = {k: v for k, v in self._nodes.items() if k in listed}
            self._absent = {k: v for k, v in self._absent.items() if k in listed}
            self._empty = {k: v for k, v in self._empty.items() if k in listed}
            self.agreed.forget(listed)
        return out

    def _moved(self, room: api.Room, node: str | None, now: float) -> bool:
        """Whether the room moved to another node (LiveKit's room_node_map) within MOVED_S."""
        sid = room.sid
        seen = self._nodes.get(sid)
        if node is None:
            return False
        if seen is None:
            self._nodes[sid] = (node, -math.inf)
            return False
        if seen[0] != node:
            self._nodes[sid] = seen = (node, now)
            log.info("room %s was made again on another node", pseudonym("room", room.name))
        return now - seen[1] < MOVED_S

    async def _ours(self, lk: LiveKit, room: api.Room) -> bool:
        """Whether the room was dispatched this agent (another agent's room is none of this watch's), asked
        of the server at most every OTHERS_S for a room that was not."""
        now = time.monotonic()
        known = self._others.get(room.sid)
        if known is not None and now - known < OTHERS_S:
            return False
        found = await lk.call(lk.api.agent_dispatch.list_dispatch, room.name)
        if any(d.agent_name == self.agent_name for d in found):
            self._others.pop(room.sid, None)
            return True
        self._others[room.sid] = now
        if len(self._others) > 4096:  # rooms long gone
            self._others = {k: t for k, t in self._others.items() if now - t < OTHERS_S}
        return False

    async def sweep(self, lk: LiveKit) -> int:
        """Ask for a new agent for each room alone that this worker claims first, the rooms at once; how many
        it asked for. A dispatch that fails gives its claim back: the room is asked for at the next sweep.
        A served room found over (`over`) is no longer served: a caller who comes back to it is a new call."""
        self.over = []
        found = await self.alone(lk)
        # the same first rooms in every worker's sweep (by sid): their claims keep the cap cluster-wide
        handed = sorted((f for f in found if f[1] == REASONS[2]), key=lambda f: f[0].sid)
        found = [f for f in found if f[1] != REASONS[2]] + handed[: max(0, HANDOVERS_AT_ONCE - self.handing)]
        asked = await asyncio.gather(*(self._dispatch(lk, room, why) for room, why in found))
        if self.over:
            await self.redis.delete(*(self.keys.served(sid) for sid in self.over))
            for sid in self.over:
                self._empty.pop(sid, None)
        return sum(asked)

    async def _dispatch(self, lk: LiveKit, room: api.Room, reason: str) -> int:
        claim = self.keys.claim(room.sid)
        if not await self.redis.set(claim, self.worker, nx=True, px=CLAIM_MS):
            return 0  # another worker has it
        if await self._taken_since(room.sid):
            await self.redis.eval(_UNMARK, 1, claim, self.worker)
            return 0
        count = f"{self.keys.prefix}count:{room.sid}"
        times = int(await self.redis.get(count) or 0) + 1
        try:
            meta = await last_metadata(lk, room.name, self.agent_name)
            meta.update({REDISPATCH_KEY: times, REASON_KEY: reason})
            await lk.call(
                lk.api.agent_dispatch.create_dispatch,
                api.CreateAgentDispatchRequest(
                    agent_name=self.agent_name, room=room.name, metadata=json.dumps(meta)
                ),
            )
        except LiveKitFailure as e:  # its node just died, say: the room made again is asked for anew
            await self.redis.eval(_UNMARK, 1, claim, self.worker)
            log.info("room %s: a new agent could not be dispatched (%s)", pseudonym("room", room.name), e)
            return 0
        await self.redis.set(count, times, ex=SERVED_S)
        if reason == REASONS[2]:
            await self.redis.set(self.keys.handing(room.sid), self.worker, px=HANDING_MS)
        self.counts[reason] += 1
        log.warning(
            "room %s had a caller and no live agent (%s): a new agent was dispatched (%d for this room)",
            pseudonym("room", room.name),
            reason,
            times,
        )
        return 1

    async def _taken_since(self, sid: str) -> bool:
        """Whether a room found alone was marked by another job, or ended on purpose, since it was looked at:
        a look waits on LiveKit's API, seconds under load, while a new agent's worker marks its room."""
        async with self.redis.pipeline(transaction=False) as p:
            p.get(self.keys.live(sid))
            p.get(self.keys.down(sid))
            p.exists(self.keys.ended(sid))
            mark, down, ended = await p.execute()
        seen = self._looked.pop(sid, None)
        return bool(ended) or (mark is not None and mark != seen and _job(mark) != _text(down))
