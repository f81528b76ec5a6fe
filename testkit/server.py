"""The LiveKit server the benchmarks and the end-to-end tests run against (scripts/livekit.sh's
start_livekit, inside a network namespace with no way out made by netns_up), the tokens callers join it
with, and the tools beside it: `python -m agent sip` (through `run_python_module`, which the tests use for
their own `python -m` commands) and LiveKit's agent load tester. Knows nothing of the worker's own figures or
of the callers' audio.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# scripts/livekit.sh: loopback and the veth pair with both ends here
ALLOWED_INTERFACES = {"lo", "lkv0", "lkv1"}


@dataclass(frozen=True)
class Server:
    url: str
    key: str
    secret: str
    redis: str = ""  # the server's Redis (host:port), where the workers mark the rooms they serve
    redis_username: str = ""  # ... and the workers' user and password there (scripts/livekit.sh)
    redis_password: str = ""

    def redis_env(self) -> dict[str, str]:
        """A worker's settings for the server's Redis (CHORUS_REDIS_URL, _USERNAME, _PASSWORD)."""
        return {
            "CHORUS_REDIS_URL": self.redis,
            "CHORUS_REDIS_USERNAME": self.redis_username,
            "CHORUS_REDIS_PASSWORD": self.redis_password,
        }

    def redis_client(self, name: str | None = None):
        """A client of the server's Redis as the workers log in to it (agent/fleet/marks.py)."""
        from agent.fleet.marks import redis_client

        return redis_client(self.redis, name, username=self.redis_username, password=self.redis_password)

    @property
    def http_url(self) -> str:
        return self.url.replace("ws://", "http://").replace("wss://", "https://")


def interfaces() -> set[str]:
    """This network namespace's interfaces (from /sys, as `ip link` lists them)."""
    return set(os.listdir("/sys/class/net"))


def leaks() -> list[str]:
    """The interfaces of this namespace that lead out of it (none inside one made by netns_up)."""
    # (a cluster's node links, testkit/nodes.py, join namespaces that have no way out either)
    return sorted(i for i in interfaces() - ALLOWED_INTERFACES if not i.startswith("lkn"))


def server_from_env(prog: str, *, confined: bool = False) -> Server:
    """The server a benchmark runs against: CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET, else
    LIVEKIT_URL/_API_KEY/_API_SECRET; `confined`: only inside a namespace with no way out. Else SystemExit,
    naming `prog`."""
    url = os.environ.get("CHORUS_TEST_LIVEKIT_URL") or os.environ.get("LIVEKIT_URL")
    key = os.environ.get("CHORUS_TEST_LIVEKIT_API_KEY") or os.environ.get("LIVEKIT_API_KEY")
    secret = os.environ.get("CHORUS_TEST_LIVEKIT_API_SECRET") or os.environ.get("LIVEKIT_API_SECRET")
    if not (url and key and secret):
        raise SystemExit(
            f"{prog}: no LiveKit server: set CHORUS_TEST_LIVEKIT_URL/_API_KEY/_API_SECRET "
            "(scripts/livekit.sh's start_livekit, inside a namespace made by netns_up) "
            "or LIVEKIT_URL/_API_KEY/_API_SECRET"
        )
    if confined and leaks():
        raise SystemExit(
            f"{prog}: this network namespace has interfaces that lead out of it: {leaks()} "
            "(run it inside one made by scripts/livekit.sh's netns_up)"
        )
    return Server(
        url,
        key,
        secret,
        *redis_from_env(),
    )


def redis_from_env() -> tuple[str, str, str]:
    """The server's Redis, and the workers' user and password there: CHORUS_TEST_LIVEKIT_REDIS(_USERNAME,
    _PASSWORD) as start_livekit exports them, else CHORUS_REDIS_URL(_USERNAME, _PASSWORD)."""
    for prefix in ("CHORUS_TEST_LIVEKIT_REDIS", "CHORUS_REDIS_URL"):
        if address := os.environ.get(prefix):
            base = prefix.removesuffix("_URL")
            return address, os.environ.get(f"{base}_USERNAME", ""), os.environ.get(f"{base}_PASSWORD", "")
    return "", "", ""


def token(server: Server, room: str, identity: str, agent_name: str | None = None, metadata: str = "") -> str:
    """A caller's join token; with `agent_name` the room dispatches that agent when the caller joins (as
    `python -m agent token` makes them), with `metadata` as the job's metadata."""
    from livekit import api

    t = (
        api.AccessToken(server.key, server.secret)
        .with_identity(identity)
        .with_grants(api.VideoGrants(room_join=True, room=room))
    )
    if agent_name:
        dispatch = api.RoomAgentDispatch(agent_name=agent_name, metadata=metadata)
        t = t.with_room_config(api.RoomConfiguration(agents=[dispatch]))
    return t.to_jwt()


def run_python_module(
    module: str, *args: str, cwd: Path, env: Mapping[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m module args...` with this interpreter, in `cwd` with `env`, its output captured as text; the
    run is stopped (subprocess.TimeoutExpired) after `timeout` seconds, when given."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def agent_sip(server: Server, *args: str, agent_name: str | None = None) -> subprocess.CompletedProcess:
    """`python -m agent sip ...` against the server (for `agent_name`'s agent, when given)."""
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.key}
    env["LIVEKIT_API_SECRET"] = server.secret
    if agent_name:
        env["LIVEKIT_AGENT_NAME"] = agent_name
    return run_python_module("agent", "sip", *args, cwd=ROOT, env=env, timeout=120)


def load_tester(prog: str) -> str:
    """LiveKit's agent load tester (scripts/agent-load-test): $CHORUS_AGENT_LOAD_TEST, else where
    scripts/livekit.sh's ensure_livekit builds it. Else SystemExit, naming `prog`."""
    path = os.environ.get("CHORUS_AGENT_LOAD_TEST")
    if not path:
        out = subprocess.run(
            ["bash", "-c", "source scripts/livekit.sh && echo $AGENT_LOAD_TEST_BIN"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        path = out.stdout.strip()
    if not Path(path).is_file():
        raise SystemExit(f"{prog}: no load tester at {path}: run scripts/livekit.sh's ensure_livekit")
    return path
