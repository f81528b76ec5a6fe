"""The fleet's Redis (scripts/livekit.sh's, the LiveKit server's own) against someone on the host: without
its password every command that could drop or swap a call is refused, run as an unprivileged user; the fleet's
own ACL user may not close other clients' connections nor touch the server's keys; and a mark forged by a
client that has the password (a live mark for a made-up job beside a presence connection named after a worker
that does not exist, then a down mark for the call's own job) neither makes the call's agent leave nor has it
swapped for another, because the fleet believes a mark only where LiveKit agrees (agent/fleet/agreed.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from livekit import api

from livekit_support import require_livekit
from testkit.callers import Caller
from testkit.worker import Worker

pytestmark = pytest.mark.livekit

FORGED_S = 8.0  # how long each forged mark is kept up: a job looks at its room's mark every 2 s (HELD_S)


@pytest.fixture(scope="module")
def server():
    s = require_livekit()
    if not (s.redis and s.redis_password):
        pytest.fail("the LiveKit server runs without Redis behind its password (scripts/livekit.sh)")
    return s


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    """`argv` run as an unprivileged user (uid nobody, when this is root)."""
    prefix = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=30)


def redis_cli(server, *command: str, user: str = "", password: str = "") -> str:
    host, port = server.redis.rsplit(":", 1)
    auth = ["--user", user, "--pass", password, "--no-auth-warning"] if password else []
    out = as_nobody("redis-cli", "-h", host, "-p", port, *auth, *command)
    return (out.stdout + out.stderr).strip()


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")
def test_without_the_password_no_one_on_the_host_can_drop_or_swap_a_call(server):
    agent, sid = "chorus-concierge", "RM_attacked"
    attacks = [
        ("CLIENT", "SETNAME", f"chorus-{agent}-w-x"),  # a worker's presence, made up
        ("SET", f"chorus:{agent}:live:{sid}", "w-x AJ_fake"),  # the room's agent leaves
        ("SET", f"chorus:{agent}:down:{sid}", "AJ_real"),  # the room's agent swapped
        ("SET", f"chorus:{agent}:ended:{sid}", "1"),  # failover off
        ("SET", f"chorus:{agent}:claim:{sid}", "w-x"),  # failover off
        ("CLIENT", "KILL", "TYPE", "normal"),  # the workers' presence connections closed
        ("CLIENT", "LIST"),
        ("KEYS", "*"),
    ]
    said = {" ".join(a): redis_cli(server, *a) for a in attacks}
    assert all(out.startswith("NOAUTH") for out in said.values()), said
    written = [f"chorus:{agent}:{kind}:{sid}" for kind in ("live", "down", "ended", "claim")]
    fleet = {"user": server.redis_username, "password": server.redis_password}
    assert redis_cli(server, "EXISTS", *written, **fleet) == "0"  # nothing of it was written
    folder = Path(os.environ["CHORUS_TEST_LIVEKIT_LOG"]).parent  # its passwords: its owner's only
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.glob("*.yaml")}
    assert modes == {"keys.yaml": 0o600, "livekit.yaml": 0o600}, modes
    assert (folder / "redis.acl").stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")
def test_the_fleets_own_user_may_not_close_connections_nor_touch_the_servers_keys(server):
    fleet = {"user": server.redis_username, "password": server.redis_password}
    refused = {
        "client kill": redis_cli(server, "CLIENT", "KILL", "TYPE", "normal", **fleet),
        "server's map": redis_cli(server, "HSET", "room_node_map", "lobby", "ND_x", **fleet),
        "server's nodes": redis_cli(server, "DEL", "nodes", **fleet),
        "flush": redis_cli(server, "FLUSHALL", **fleet),
        "config": redis_cli(server, "CONFIG", "SET", "requirepass", "x", **fleet),
    }
    assert all(out.startswith("NOPERM") for out in refused.values()), refused
    allowed = redis_cli(server, "SET", "chorus:test-acl:live:RM_x", "w-a AJ_1", "PX", "1000", **fleet)
    assert allowed == "OK"
    assert redis_cli(server, "HGET", "room_node_map", "lobby", **fleet) == ""  # read, not written


def test_a_forged_mark_neither_makes_a_calls_agent_leave_nor_swaps_it(server, store_dir):
    """A client with the fleet's password forges, for FORGED_S each: a presence connection named after a
    worker that does not exist and a live mark for a made-up job on the call's room (before: the agent left
    about 2 s later), then a down mark for the call's own job (before: a new agent was sent at once). The
    caller keeps its one agent throughout, and no new agent is dispatched."""
    from agent.fleet.marks import Keys, presence_name

    name = f"chorus-test-{uuid.uuid4().hex[:8]}"
    keys = Keys(name)

    async def forge(redis, key: str, value: str) -> None:
        until = time.monotonic() + FORGED_S
        while time.monotonic() < until:  # written again and again, as someone who means it would
            await redis.set(key, value, px=2000)
            await asyncio.sleep(0.2)

    async def call(worker: Worker) -> tuple[Caller, str]:
        caller = Caller(server, f"fleet-{uuid.uuid4().hex[:8]}", name)
        await caller.join()
        await asyncio.wait_for(caller.first_speech.wait(), 90)
        lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
        redis, presence = server.redis_client(), server.redis_client(presence_name(name, "w-x"))
        try:
            rooms = await lk.room.list_rooms(api.ListRoomsRequest(names=[caller.room_name]))
            sid = rooms.rooms[0].sid
            job = caller.heard.agent_identity.removeprefix("agent-")
            await presence.ping()  # a worker w-x, as Redis' client list has it
            await forge(redis, keys.live(sid), "w-x AJ_fake")
            await redis.delete(keys.live(sid))
            await forge(redis, keys.down(sid), job)
            await redis.delete(keys.down(sid))
            await asyncio.sleep(2.0)  # what the last forged mark would have brought
        finally:
            await lk.aclose()
            await redis.aclose()
            await presence.aclose()
        await caller.leave()
        return caller, worker.log.read_text(errors="replace")

    worker = Worker(server, store_dir, slots=2, name=name)
    try:
        worker.start()
        caller, log = asyncio.run(call(worker))
    finally:
        worker.stop()
    assert caller.heard.agents == {caller.heard.agent_identity}, caller.heard.summary()
    assert caller.heard.agents_left == [], caller.heard.summary()
    fleet = [line for line in log.splitlines() if "chorus.agent.fleet" in line]
    assert not any("a new agent was dispatched" in line or "it leaves" in line for line in fleet), fleet
    assert any("not believed" in line or "as LiveKit sees it" in line for line in fleet), fleet
