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
  marked the room meanwhile, this one leaves: the room has its new agent (`watch_link`). A job that ends
  while its connection is down leaves the mark standing (ENDED_DOWN_MS): its worker lists it, and would mark
  the room live, until its process has exited.
- **Believed.** A mark is anyone's to write who can write to Redis, while only the server puts an agent in a
  room: a live mark counts while LiveKit lists its job's agent in the room (read again every AGREED_S for a
  room held; or for its first JOIN_S), a down mark only while LiveKit does not, and a room whose live mark
  names a job LiveKit does not know is its agent's still while an agent of one of the room's jobs is in it
  (agent/fleet/agreed.py). So a mark forged by hand neither makes a call's agent leave nor swaps it.
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
  `...:handover:<room sid>` (`Keys.drained`): they are alone at the next sweep, and the new agent in each
  takes the call over from the draining one, which talks on until the new one's session is live and then is
  removed by it. With no other worker to take them, its calls end as a drain's do (agent/fleet/drain.py).
  They are handed over HANDOVERS_AT_ONCE at a time (the same rooms in every worker's sweep, the lowest
  sids): a handover asked for marks the room `...:handing:<room sid>` (`Keys.handover_asked`) until its new
  agent marks it (HANDING_MS at most, and only while the draining worker lives), and such a room is not
  alone meanwhile.
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

A sweep is three steps: read (the server's rooms, their marks, which workers are gone; then, room by room,
what its verdict needs: participants, dispatches), classify (agent/fleet/classify.py, a pure function: a
verdict per room), act (a moved room's job marked down, a new dispatch per room alone, calls over
forgotten). A dispatch whose call failed without an answer counts as made until the room's dispatch list
says otherwise (agent/fleet/dispatches.py). Each new dispatch is counted (handed to the engine through its
door: `redispatches` in the snapshot and on the monitoring page, `chorus_redispatches_total{reason}` on
/metrics) and logged with the room's pseudonym, never its name. A worker's part is `Fleet`, here, which its
watch runs (agent/fleet/worker_watch.py); a room's job's part is agent/fleet/room_job.py; the marks' keys and
scripts are agent/fleet/marks.py, a room's state and `Reason` agent/fleet/state.py, the timings
agent/fleet/timing.py (docs/deployment.md draws the moves). Knows LiveKit's room and dispatch API and Redis;
nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from livekit import api

from agent.fleet import timing
from agent.fleet.classify import Memory, Need, Seen, Verdict, classify
from agent.fleet.dispatches import Asked, ask_for_agent, last_metadata
from agent.fleet.gone import Presences
from agent.fleet.marks import _MARK, _UNMARK, Keys, _job, _owner, _text, one_per_room
from agent.fleet.state import REASON_KEY as REASON_KEY
from agent.fleet.state import REDISPATCH_KEY as REDISPATCH_KEY
from agent.fleet.state import Reason, RoomState, decode, queue_reads
from agent.fleet.timing import BEAT_S as BEAT_S
from agent.fleet.timing import SWEEP_S as SWEEP_S
from agent.lkapi import LiveKitFailure
from redaction import pseudonym

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from agent.lkapi import LiveKit

log = logging.getLogger("chorus.agent.fleet")


@dataclass(frozen=True)
class Found:
    """A room a sweep read, with its verdict."""

    room: api.Room
    state: RoomState
    verdict: Verdict


class Fleet:
    """One worker's part in the fleet: `beat(jobs)` marks the rooms of its running jobs (each a
    (room sid, job id)) and unmarks those that ended; `sweep(lk)` asks for a new agent for every room alone
    that it claims first. `counts` per reason (its value), for the snapshot; `clock` is wall time (a
    participant's `joined_at` is)."""

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
        self.counts = {r.value: 0 for r in Reason}
        self._others: dict[str, float] = {}  # room sid -> when it was last found another agent's
        self.memory: dict[str, Memory] = {}  # room sid -> what the sweeps remember of it
        self.over: list[str] = []  # rooms whose call ended with no agent in them, since `sweep` last ran
        self.presences = Presences(redis, agent_name, worker)  # the other workers' presence connections
        self.handing_over = False  # the worker drains: its rooms go to other workers
        self.handing = 0  # handovers asked for and on their way, as the last sweep found them

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
                    p.set(self.keys.drained(sid), self.worker, ex=timing.HANDOVER_S)
                await p.execute()
            now = {}
        order = list(now.items())
        marks: list[object] = []
        if order:
            live_ms = timing.LIVE_MS
            async with self.redis.pipeline(transaction=False) as p:
                for sid, job in order:
                    p.eval(_MARK, 2, self.keys.live(sid), self.keys.down(sid), self._mark(job), live_ms, job)
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
                    p.set(self.keys.live(sid), self._mark(job), px=timing.LIVE_MS)
                p.set(self.keys.served(sid), job, ex=timing.SERVED_S)
                if sid not in self.marked:  # a new agent here: a handover, if it was one, is done
                    p.delete(self.keys.drained(sid), self.keys.handover_asked(sid))
            for sid, job in self.marked.items():
                if now.get(sid) != job:
                    p.eval(_UNMARK, 1, self.keys.live(sid), self._mark(job))
            await p.execute()
        self.marked = now

    async def sweep(self, lk: LiveKit) -> int:
        """Read, classify, act: ask for a new agent for each room alone that this worker claims first, the
        rooms at once; how many it asked for. A dispatch not made gives its claim back: the room is asked for
        at the next sweep. A served room found over (`over`) is no longer served: a caller who comes back to
        it is a new call."""
        self.over = []
        found = await self.look(lk)
        return await self._act(lk, found)

    async def look(self, lk: LiveKit) -> list[Found]:
        """Read every room and classify it, writing nothing to Redis: the rooms with their verdicts, whose
        memory is kept for the next sweep. A room that could not be looked at (its node just died) holds up
        none of the others."""
        # every room: a room's `num_participants` in the server's list lags its participants by seconds
        rooms = list((await lk.call(lk.api.room.list_rooms, api.ListRoomsRequest())).rooms)
        listed = {r.sid for r in rooms}
        self.memory = {sid: m for sid, m in self.memory.items() if sid in listed}  # rooms gone: forgotten
        if not rooms:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for r in rooms:
                queue_reads(p, self.keys, r)
            states = decode(await p.execute())
        # the workers named by marks whose presence connection is gone
        named = {w for s in states for w in (s.worker, s.drained_by) if w}
        gone = frozenset(await self.presences.gone(named))
        now, wall = time.monotonic(), self.clock()
        looks = (self._classify(lk, r, Seen(s, gone), now, wall) for r, s in zip(rooms, states, strict=True))
        verdicts = await asyncio.gather(*looks, return_exceptions=True)
        out = []
        for room, state, v in zip(rooms, states, verdicts, strict=True):
            if isinstance(v, LiveKitFailure):
                log.info("a room could not be looked at (%s)", v)
            elif isinstance(v, BaseException):
                raise v
            else:
                self.memory[room.sid] = v.memory
                out.append(Found(room, state, v))
        return out

    async def _classify(self, lk: LiveKit, room: api.Room, seen: Seen, now: float, wall: float) -> Verdict:
        """The room's verdict, reading what it needs first (each at most once)."""
        memory = self.memory.get(room.sid, Memory())
        while (verdict := classify(seen, memory, now, wall)).need is not None:
            if verdict.need is Need.PARTICIPANTS:
                req = api.ListParticipantsRequest(room=room.name)
                people = await lk.call(lk.api.room.list_participants, req)
                seen = Seen(seen.state, seen.gone, tuple(people.participants), seen.ours, seen.jobs)
            else:
                seen = await self._dispatches(lk, room, seen, verdict.need)
        return verdict

    async def _dispatches(self, lk: LiveKit, room: api.Room, seen: Seen, need: Need) -> Seen:
        """`seen` with the room's dispatches of this agent read: whether it has one, and their jobs. A room
        found to have none is not asked about again for OTHERS_S (another agent's room is none of this
        watch's)."""
        now = time.monotonic()
        known = self._others.get(room.sid)
        if need is Need.OURS and known is not None and now - known < timing.OTHERS_S:
            return Seen(seen.state, seen.gone, seen.people, False, frozenset())
        found = [d for d in await lk.call(lk.api.agent_dispatch.list_dispatch, room.name)]
        mine = [d for d in found if d.agent_name == self.agent_name]
        if mine:
            self._others.pop(room.sid, None)
        else:
            self._others[room.sid] = now
            if len(self._others) > 4096:  # rooms long gone
                self._others = {k: t for k, t in self._others.items() if now - t < timing.OTHERS_S}
        jobs = frozenset(j.id for d in mine for j in d.state.jobs)
        return Seen(seen.state, seen.gone, seen.people, bool(mine), jobs)

    async def _act(self, lk: LiveKit, found: list[Found]) -> int:
        """What the verdicts ask: moved rooms' jobs taken as down, a new dispatch for each room alone (the
        handovers a few at a time), the calls over no longer served; how many dispatches were asked for."""
        self.handing = sum(f.verdict.on_its_way for f in found)
        for f in found:
            if f.verdict.moved:
                log.info("room %s was made again on another node", pseudonym("room", f.room.name))
            if f.verdict.warn:
                log.warning("room %s: %s; not believed", pseudonym("room", f.room.name), f.verdict.warn)
        downs = [f for f in found if f.verdict.take_down is not None]
        for f in downs:
            await self.redis.set(self.keys.down(f.room.sid), f.verdict.take_down, px=timing.MOVED_DOWN_MS)
        alone = [f for f in found if f.verdict.why is not None]
        # the same first rooms in every worker's sweep (by sid): their claims keep the cap cluster-wide
        handed = sorted((f for f in alone if f.verdict.why is Reason.HANDED_OVER), key=lambda f: f.room.sid)
        alone = [f for f in alone if f.verdict.why is not Reason.HANDED_OVER]
        alone += handed[: max(0, timing.HANDOVERS_AT_ONCE - self.handing)]
        asked = await asyncio.gather(*(self._dispatch(lk, f) for f in alone))
        self.over = [f.room.sid for f in found if f.verdict.over]
        if self.over:
            await self.redis.delete(*(self.keys.served(sid) for sid in self.over))
        return sum(asked)

    async def _dispatch(self, lk: LiveKit, f: Found) -> int:
        room, reason = f.room, f.verdict.why
        assert reason is not None
        claim = self.keys.claim(room.sid)
        if not await self.redis.set(claim, self.worker, nx=True, px=timing.CLAIM_MS):
            return 0  # another worker has it
        if await self._taken_since(room.sid, f.state):
            await self.redis.eval(_UNMARK, 1, claim, self.worker)
            return 0
        count = self.keys.count(room.sid)
        times = int(await self.redis.get(count) or 0) + 1
        handing = self.keys.handover_asked(room.sid) if reason is Reason.HANDED_OVER else None
        if handing is not None:
            # on its way from before the ask: the new job removes it when it first marks the room, which on a
            # busy server can come before the ask's answer (marked after, it would hold a turn HANDING_MS)
            await self.redis.set(handing, self.worker, px=timing.HANDING_MS)
        try:
            meta = await last_metadata(lk, room.name, self.agent_name)
            asked = await ask_for_agent(lk, self.agent_name, room.name, meta, times, reason)
        except LiveKitFailure as e:  # not made (its node just died, say): the room made again is asked anew
            await self.redis.eval(_UNMARK, 1, claim, self.worker)
            if handing is not None:
                await self.redis.eval(_UNMARK, 1, handing, self.worker)
            log.info("room %s: a new agent could not be dispatched (%s)", pseudonym("room", room.name), e)
            return 0
        # made, or not known to be: counted as made, its claim kept (the room is asked for again once it
        # expires if no agent came)
        await self.redis.set(count, times, ex=timing.SERVED_S)
        self.counts[reason.value] += 1
        log.warning(
            "room %s had a caller and no live agent (%s): a new agent was dispatched (%d for this room%s)",
            pseudonym("room", room.name),
            reason.value,
            times,
            "" if asked is Asked.MADE else f"; its call failed, {asked.value}",
        )
        return 1

    async def _taken_since(self, sid: str, seen: RoomState) -> bool:
        """Whether a room found alone was marked by another job, or ended on purpose, since it was read (as
        `seen`): a look waits on LiveKit's API, seconds under load, while a new agent's worker marks its
        room."""
        async with self.redis.pipeline(transaction=False) as p:
            p.get(self.keys.live(sid))
            p.get(self.keys.down(sid))
            p.exists(self.keys.ended(sid))
            mark, down, ended = await p.execute()
        mark, down = _text(mark), _text(down)
        return bool(ended) or (mark is not None and mark != seen.live and _job(mark) != down)
