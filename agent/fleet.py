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
- **Alone.** Every SWEEP_S each worker lists the server's rooms; a room of this agent (served, or with a
  dispatch of its name) with no live mark and a caller (a standard or SIP participant) is alone if it was
  served, or if its caller has waited FIRST_AGENT_S for the server's own dispatch.
- **Handed over.** A worker that drains (SIGTERM: a rolling restart) stops marking its rooms and marks each
  `...:handover:<room sid>`: they are alone at the next sweep, and the new agent in each takes the call over
  from the draining one, which talks on until the new one's session is live and then is removed by it. With
  no other worker to take them, its calls end as a drain's do (agent/drain.py).
- **Ended.** A call that ends on purpose (its caller left or was said goodbye to, transferred, hung up)
  marks its room `...:ended:<room sid>`: a caller still in it is not sent another agent.
- **One new agent.** Of the workers that find a room alone, the one that sets `...:claim:<room sid>` first
  (SET NX, expiring after CLAIM_MS) asks for the dispatch; the others leave it. A dispatch that brings no
  agent in that time is asked for again. The new job removes the agents left in the room from before
  (`remove_stale_agents`), so no two answer the caller.

Each new dispatch is counted (handed to the engine through its door: `redispatches` in the snapshot and on
the monitoring page, `chorus_redispatches_total{reason}` on /metrics) and logged with the room's
pseudonym, never its name. Knows LiveKit's room and dispatch API and
Redis; nothing of the engine or the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from livekit import api

from redaction import pseudonym

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from agent.lkapi import LiveKit
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.fleet")

BEAT_S = 0.5  # how often a worker marks its rooms live
LIVE_MS = 2000  # a mark not renewed this long is a dead agent's
GONE_S = 0.3  # a worker whose connection is missing from Redis this long (two sweeps) is dead
SERVED_S = 3600  # how long a room is remembered to have had an agent, after its last mark
SWEEP_S = 0.5  # how often a worker looks for rooms alone
FIRST_AGENT_S = 5.0  # a caller who has waited this long for the room's first agent gets one asked for
OTHERS_S = 10.0  # a room dispatched no agent of this name is asked about again after this long
CLAIM_MS = 5000  # one new dispatch per room in this long, cluster-wide (a new job marks its room at launch)
REDISPATCH_KEY = "chorus_redispatched"  # in a dispatch's metadata: how often its room's agent was replaced
REASON_KEY = "chorus_reason"  # ... and why, this time

CALLER_KINDS = (api.ParticipantInfo.Kind.STANDARD, api.ParticipantInfo.Kind.SIP)
PRESENT = (api.ParticipantInfo.State.JOINED, api.ParticipantInfo.State.ACTIVE)

REASONS = ("agent lost", "never answered", "handed over")
HANDOVER_S = 60  # a room handed over is known as such this long (until its new agent marks it)


def redis_client(url: str, name: str | None = None) -> Redis:
    """A client of the cluster's Redis at `url` (LiveKit's own form, host:port, or a redis:// URL); with
    `name`, one connection of that client name (a worker's presence)."""
    from redis.asyncio import Redis

    if "://" not in url:
        url = f"redis://{url}"
    extra: dict[str, Any] = {"client_name": name, "single_connection_client": True} if name else {}
    return Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, **extra)


def presence_name(agent_name: str, worker: str) -> str:
    """The client name of a worker's presence connection (Redis allows no spaces or newlines in one)."""
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in f"chorus-{agent_name}-{worker}")


class Keys:
    """The Redis keys of one agent name's rooms."""

    def __init__(self, agent_name: str) -> None:
        self.prefix = f"chorus:{agent_name}:"

    def live(self, sid: str) -> str:
        return f"{self.prefix}live:{sid}"

    def served(self, sid: str) -> str:
        return f"{self.prefix}served:{sid}"

    def claim(self, sid: str) -> str:
        return f"{self.prefix}claim:{sid}"

    def ended(self, sid: str) -> str:
        return f"{self.prefix}ended:{sid}"

    def handover(self, sid: str) -> str:
        return f"{self.prefix}handover:{sid}"


# a job's mark removed only while it is still that job's (a newer job may have marked the room since)
# (a mark's value: "<worker> <job id>")
_UNMARK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


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
        self._missing: dict[str, float] = {}  # worker -> when its connection was first found missing
        self._clients = True  # Redis answers CLIENT LIST (an ACL may forbid it: then marks alone tell)
        self.handing_over = False  # the worker drains: its rooms go to other workers

    def _mark(self, job: str) -> str:
        return f"{self.worker} {job}"

    async def beat(self, jobs: list[tuple[str, str]]) -> None:
        if self.presence is not None:
            await self.presence.ping()  # (re)opens this worker's named connection before its marks
        now = dict(jobs)
        async with self.redis.pipeline(transaction=False) as p:
            if self.handing_over:  # none of its rooms is marked live from now on
                for sid in now:
                    p.set(self.keys.handover(sid), self.worker, ex=HANDOVER_S)
                now = {}
            for sid, job in now.items():
                p.set(self.keys.live(sid), self._mark(job), px=LIVE_MS)
                p.set(self.keys.served(sid), job, ex=SERVED_S)
                if sid not in self.marked:  # a new agent here: a handover, if it was one, is done
                    p.delete(self.keys.handover(sid))
            for sid, job in self.marked.items():
                if now.get(sid) != job:
                    p.eval(_UNMARK, 1, self.keys.live(sid), self._mark(job))
            await p.execute()
        self.marked = now

    async def _gone(self, workers: set[str]) -> set[str]:
        """Of the workers named by live marks, those whose presence connection has been missing from Redis
        for GONE_S (their process died); none when Redis does not list its clients to this worker."""
        workers.discard(self.worker)
        if not workers or not self._clients:
            return set()
        try:
            clients = await self.redis.client_list(_type="normal")
        except _redis_errors() as e:
            if "NOPERM" not in str(e) and "unknown command" not in str(e).lower():
                raise
            self._clients = False
            log.warning(
                "Redis does not list its clients to this worker: a dead worker's rooms wait for marks"
            )
            return set()
        names = {c.get("name", "") for c in clients}
        now = time.monotonic()
        gone = set()
        for w in workers:
            if presence_name(self.agent_name, w) in names:
                self._missing.pop(w, None)
            elif now - self._missing.setdefault(w, now) >= GONE_S:
                gone.add(w)
        if len(self._missing) > 1024:  # workers long gone
            self._missing = {w: t for w, t in self._missing.items() if now - t < 3600}
        return gone

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
                p.exists(self.keys.handover(r.sid))
            marks = await p.execute()
        owners = [_owner(m) for m in marks[::4]]
        gone = await self._gone({w for w in owners if w})
        out = []
        for i, room in enumerate(rooms):
            live, served, ended, handover = marks[4 * i : 4 * i + 4]
            live = live is not None and owners[i] not in gone
            if live or ended or not (served or await self._ours(lk, room)):
                continue
            people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room.name))
            callers = [p for p in people.participants if p.kind in CALLER_KINDS and p.state in PRESENT]
            if not callers:
                continue
            if served:
                out.append((room, REASONS[2] if handover else REASONS[0]))
            elif self.clock() - min(p.joined_at for p in callers) >= FIRST_AGENT_S:
                out.append((room, REASONS[1]))
        return out

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
        """Ask for a new agent for each room alone that this worker claims first; how many it asked for."""
        asked = 0
        for room, reason in await self.alone(lk):
            if not await self.redis.set(self.keys.claim(room.sid), self.worker, nx=True, px=CLAIM_MS):
                continue  # another worker has it
            times = int(await self.redis.incr(f"{self.keys.prefix}count:{room.sid}"))
            await self.redis.expire(f"{self.keys.prefix}count:{room.sid}", SERVED_S)
            meta = await self._metadata(lk, room.name)
            meta.update({REDISPATCH_KEY: times, REASON_KEY: reason})
            meta = json.dumps(meta)
            await lk.call(
                lk.api.agent_dispatch.create_dispatch,
                api.CreateAgentDispatchRequest(agent_name=self.agent_name, room=room.name, metadata=meta),
            )
            self.counts[reason] += 1
            asked += 1
            log.warning(
                "room %s had a caller and no live agent (%s): a new agent was dispatched (%d for this room)",
                pseudonym("room", room.name),
                reason,
                times,
            )
        return asked

    async def _metadata(self, lk: LiveKit, room: str) -> dict[str, Any]:
        """The metadata the room's last dispatch of this agent carried (a phone call's purpose, a test's
        script), for the new one to carry too: a JSON object's fields, or anything else under `metadata`."""
        found = await lk.call(lk.api.agent_dispatch.list_dispatch, room)
        mine = [d for d in found if d.agent_name == self.agent_name]
        if not mine:
            return {}
        last = max(mine, key=lambda d: d.state.created_at)
        try:
            meta = json.loads(last.metadata or "{}")
        except ValueError:
            meta = None
        return meta if isinstance(meta, dict) else {"metadata": last.metadata}


def _owner(mark: bytes | str | None) -> str | None:
    """The worker a live mark names (None: no mark, or one without a worker's name)."""
    if mark is None:
        return None
    text = mark.decode(errors="replace") if isinstance(mark, bytes) else mark
    worker, sep, _job = text.rpartition(" ")
    return worker if sep else None


async def watch(
    settings: AgentSettings,
    worker: str,
    jobs: Callable[[], list[tuple[str, str]]],
    report: Callable[[dict[str, int]], None] | None = None,
    handing_over: Callable[[], bool] = lambda: False,
) -> None:
    """The worker's watch, until cancelled: its rooms marked every BEAT_S (`jobs()`: its running jobs'
    (room sid, job id)) until `handing_over()` (the worker drains), rooms alone looked for every SWEEP_S, and
    the counts of new agents handed to `report` (in a thread: the engine's snapshot) whenever they change.
    A failure of Redis or of LiveKit's API is logged (once while it lasts) and tried again."""
    from agent.lkapi import LiveKit, LiveKitFailure

    presence = redis_client(settings.redis_url, name=presence_name(settings.agent_name, worker))
    fleet = Fleet(redis_client(settings.redis_url), settings.agent_name, worker, presence=presence)
    failing = False
    next_sweep = 0.0
    try:
        async with LiveKit(settings) as lk:
            while True:
                try:
                    fleet.handing_over = handing_over()
                    await fleet.beat(jobs())
                    if time.monotonic() >= next_sweep and not fleet.handing_over:  # its rooms are others'
                        next_sweep = time.monotonic() + SWEEP_S
                        if await fleet.sweep(lk) and report is not None:
                            await asyncio.to_thread(report, dict(fleet.counts))
                    if failing:
                        log.info("the fleet's watch works again")
                    failing = False
                except (LiveKitFailure, OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
                    if not failing:
                        log.warning("the fleet's watch failed (%s); trying again", type(e).__name__)
                    failing = True
                except Exception:  # a defect: logged with its stack, and the watch goes on
                    log.exception("the fleet's watch failed")
                    failing = True
                await asyncio.sleep(BEAT_S)
    finally:
        await fleet.redis.aclose()
        await presence.aclose()


def _redis_errors() -> type[Exception]:
    from redis.exceptions import RedisError

    return RedisError


async def remove_stale_agents(lk: LiveKit, room: str, own_identity: str) -> int:
    """A new agent's job, dispatched for a room whose agent was lost: remove the other agents of the room
    (a dead worker's stays for about 20 s, until the server drops it), so no two answer the caller; how
    many were removed."""
    people = await lk.call(lk.api.room.list_participants, api.ListParticipantsRequest(room=room))
    stale = [
        p.identity
        for p in people.participants
        if p.kind == api.ParticipantInfo.Kind.AGENT and p.identity != own_identity
    ]
    for identity in stale:
        await lk.call(
            lk.api.room.remove_participant, api.RoomParticipantIdentity(room=room, identity=identity)
        )
    return len(stale)


async def release_room(settings: AgentSettings, sid: str) -> None:
    """A call ended on purpose (its caller left or was said goodbye to, transferred, hung up): its room is
    no longer the fleet's to keep served, so a caller still in it is not given a new agent. Best effort."""
    if not settings.redis_url:
        return
    keys = Keys(settings.agent_name)
    client = redis_client(settings.redis_url)
    try:
        async with client.pipeline(transaction=True) as p:
            p.set(keys.ended(sid), "1", ex=SERVED_S)
            p.delete(keys.served(sid), keys.live(sid))
            await p.execute()
    except (OSError, ConnectionError, TimeoutError, _redis_errors()) as e:
        log.info("the room's mark could not be removed (%s)", type(e).__name__)
    finally:
        await client.aclose()


def redispatched(metadata: str | None) -> dict[str, Any] | None:
    """What a job's dispatch metadata says of a new agent for a lost one (None: the room's first)."""
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        return None
    if isinstance(meta, dict) and meta.get(REDISPATCH_KEY):
        return meta
    return None
