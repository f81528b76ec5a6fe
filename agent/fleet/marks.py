"""The fleet's marks in the cluster's Redis (agent/fleet/fleet.py): the keys of one agent name's rooms, the
scripts that mark a job's room live and unmark it only while the mark is still that job's, what a mark names
(its worker and its job), the clients of that Redis (a worker's presence is one connection of its own name),
and which workers' presence connections Redis lists. Knows Redis and the keys' layout; nothing of LiveKit,
the engine or the call.
"""

from __future__ import annotations

from functools import partialmethod
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from agent.settings import AgentSettings


def redis_client(url: str, name: str | None = None, *, username: str = "", password: str = "") -> Redis:
    """A client of the cluster's Redis at `url` (LiveKit's own form, host:port, or a redis:// URL, which may
    carry its credentials), as `username` with `password` where given (an ACL user, or the password alone
    for `requirepass`); with `name`, one connection of that client name (a worker's presence)."""
    from redis.asyncio import Redis

    if "://" not in url:
        url = f"redis://{url}"
    extra: dict[str, Any] = {"client_name": name, "single_connection_client": True} if name else {}
    if password:  # these win over the URL's own (redis-py takes the URL's first)
        parts = urlsplit(url)
        url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        extra.update(password=password, username=username or None)
    return Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, **extra)


def fleet_redis(settings: AgentSettings, name: str | None = None) -> Redis:
    """A client of the cluster's Redis as `settings` name it (CHORUS_REDIS_URL, _USERNAME, _PASSWORD)."""
    return redis_client(
        settings.redis_url, name, username=settings.redis_username, password=settings.redis_password
    )


def presence_name(agent_name: str, worker: str) -> str:
    """The client name of a worker's presence connection (Redis allows no spaces or newlines in one)."""
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in f"chorus-{agent_name}-{worker}")


class Keys:
    """The Redis keys of one agent name's rooms."""

    def __init__(self, agent_name: str) -> None:
        self.prefix = f"chorus:{agent_name}:"

    def _key(self, kind: str, sid: str) -> str:
        return f"{self.prefix}{kind}:{sid}"

    # each room's marks, by its sid (agent/fleet/fleet.py says what each means)
    live = partialmethod(_key, "live")
    served = partialmethod(_key, "served")
    claim = partialmethod(_key, "claim")
    count = partialmethod(_key, "count")  # how often the room's agent was replaced
    ended = partialmethod(_key, "ended")
    down = partialmethod(_key, "down")
    # a drain's two marks: its worker drains and hands the room over, and a handover asked for is on its way.
    # Their keys keep the names older workers read ("handover", "handing"): a drain is a rolling restart, and
    # a worker of either version must read the other's.
    drained = partialmethod(_key, "handover")
    handover_asked = partialmethod(_key, "handing")


# a job's mark removed only while it is still that job's (a newer job may have marked the room since)
# (a mark's value: "<worker> <job id>")
_UNMARK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# a job's room marked live (KEYS: live, down; ARGV: mark, ms, job): not while the job is down (0), nor over
# another job's mark unless that job is down (that mark returned: the room has its agent); else marked (1)
_MARK = """
local down = redis.call('get', KEYS[2])
if down == ARGV[3] then return 0 end
local cur = redis.call('get', KEYS[1])
if cur and cur ~= ARGV[1] and down ~= string.match(cur, '[^ ]+$') then return cur end
redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2])
return 1
"""


async def one_per_room(redis: Redis, keys: Keys, jobs: list[tuple[str, str]]) -> dict[str, str]:
    """The job marked for each room of one worker's `jobs` (room sid, job id; oldest first): of two jobs for
    one room (a new agent dispatched beside one whose connection is down, or two dispatches racing), the
    oldest that is not down keeps it, as across workers the one marked first does; all down, the newest (the
    fleet's replacement is on its way)."""
    rooms: dict[str, list[str]] = {}
    for sid, job in jobs:
        rooms.setdefault(sid, []).append(job)
    shared = [sid for sid, js in rooms.items() if len(js) > 1]
    if not shared:
        return {sid: js[0] for sid, js in rooms.items()}
    downs = dict(zip(shared, map(_text, await redis.mget([keys.down(s) for s in shared])), strict=True))
    return {sid: next((j for j in js if j != downs.get(sid)), js[-1]) for sid, js in rooms.items()}


def _text(value: bytes | str | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _owner(mark: bytes | str | None) -> str | None:
    """The worker a live mark names (None: no mark, or one without a worker's name)."""
    if mark is None:
        return None
    worker, sep, _job = _text(mark).rpartition(" ")
    return worker if sep else None


def _job(mark: bytes | str | None) -> str | None:
    """The job a live mark names (None: no mark)."""
    if mark is None:
        return None
    return _text(mark).rpartition(" ")[2]


def _redis_errors() -> type[Exception]:
    from redis.exceptions import RedisError

    return RedisError


async def present_workers(client: Redis, agent_name: str, workers: set[str]) -> set[str] | None:
    """Which of `workers` (of agent `agent_name`) have their presence connection open: the ones Redis lists
    among its clients. None when Redis does not list its clients to this one (an ACL forbids CLIENT LIST);
    other Redis errors are raised."""
    try:
        clients = await client.client_list(_type="normal")
    except _redis_errors() as e:
        if "NOPERM" not in str(e) and "unknown command" not in str(e).lower():
            raise
        return None
    names = {c.get("name", "") for c in clients}
    return {w for w in workers if presence_name(agent_name, w) in names}
