"""A LiveKit cluster of two or more nodes on one machine, each node a host of its own: a network namespace
joined to this one by a veth pair (`lkn<i>` here, `lkn<i>p` there; this namespace routes between the nodes),
running its own livekit-server. The nodes share one Redis, run here, which is what makes them a cluster. Made
inside a namespace with no way out (netns_up's), the nodes have none either. Needs root and `ip`.

A `Balancer` stands where a cluster's load balancer stands: a TCP proxy that hands each new connection to the
first node that accepts it, so a client that reconnects after its node died (as LiveKit's SDKs do, to the URL
they were given) reaches a node that lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from testkit.server import Server

PORT = 7880  # each node's own, in its own namespace
UDP = 7882


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


class Node:
    """Node `index` (1, 2, ...): its namespace, its address (10.98.<index>.2) and its server."""

    def __init__(self, index: int, tag: str) -> None:
        self.index = index
        self.ns = f"chorus-node-{tag}-{index}"
        self.host_ip = f"10.98.{index}.1"  # this namespace's end of its link
        self.ip = f"10.98.{index}.2"
        self.link = f"lkn{index}"
        self.proc: subprocess.Popen | None = None
        self.url = f"ws://{self.ip}:{PORT}"

    def up(self) -> Node:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", f"{self.link}p")
        _ip("link", "set", f"{self.link}p", "netns", self.ns)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("link", "set", "lo", "up", ns=self.ns)
        _ip("addr", "add", f"{self.ip}/24", "dev", f"{self.link}p", ns=self.ns)
        _ip("link", "set", f"{self.link}p", "up", ns=self.ns)
        _ip("route", "add", "default", "via", self.host_ip, ns=self.ns)
        return self

    def start(self, binary: str, folder: Path, keys: Path, redis: str) -> None:
        """Its livekit-server, sharing `redis`, with the cluster's `keys`; waits until it answers."""
        config = folder / f"node-{self.index}.yaml"
        config.write_text(
            f"port: {PORT}\n"
            f'bind_addresses: ["{self.ip}"]\n'
            "rtc:\n"
            f"  udp_port: {UDP}\n"
            "  tcp_port: 0\n"
            "  use_external_ip: false\n"
            f"  node_ip: {self.ip}\n"
            "  enable_loopback_candidate: false\n"
            f"  interfaces: {{includes: [{self.link}p]}}\n"
            '  stun_servers: ["127.0.0.1:9"]\n'
            "logging: {level: info, pion_level: error}\n"
            f"redis: {{address: {redis}}}\n"
        )
        self.log = folder / f"node-{self.index}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns,
                    binary,
                    "--dev",
                    "--config",
                    str(config),
                    "--key-file",
                    str(keys),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.index}'s server exited:\n{self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://{self.ip}:{PORT}/", timeout=1).read().strip() == b"OK":
                    return
            time.sleep(0.2)
        raise AssertionError(f"node {self.index}'s server did not answer:\n{self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """The node dies: its server killed (SIGKILL), as when its host is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def down(self) -> None:
        self.kill()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # its link goes with it


class Cluster(contextlib.AbstractContextManager):
    """`n` nodes sharing one Redis; `server(i)` is node i's, as the workers and callers there see it."""

    def __init__(self, n: int = 2) -> None:
        binary = os.environ.get("CHORUS_LIVEKIT_SERVER") or shutil.which("livekit-server")
        if not binary:
            raise RuntimeError("no livekit-server (scripts/livekit.sh's ensure_livekit builds it)")
        self.binary = binary
        self.tag = f"{os.getpid()}"
        self.nodes = [Node(i + 1, self.tag) for i in range(n)]
        self.folder = Path(tempfile.mkdtemp(prefix="chorus-cluster-"))
        self.key, self.secret = "chorus", secrets.token_hex(24)
        self.redis_proc: subprocess.Popen | None = None

    def __enter__(self) -> Cluster:
        try:
            for node in self.nodes:
                node.up()
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")  # this namespace routes between the nodes
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.redis_port = s.getsockname()[1]
            binds = [n.host_ip for n in self.nodes] + ["127.0.0.1"]
            self.redis_proc = subprocess.Popen(
                [
                    "redis-server",
                    "--bind",
                    *binds,
                    "--port",
                    str(self.redis_port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
            )
            _wait_port("127.0.0.1", self.redis_port)
            keys = self.folder / "keys.yaml"
            keys.touch(mode=0o600)
            keys.write_text(f"{self.key}: {self.secret}\n")
            for node in self.nodes:
                node.start(self.binary, self.folder, keys, f"{node.host_ip}:{self.redis_port}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def server(self, i: int, url: str | None = None) -> Server:
        """Node i (from 0) as its workers see it: its URL (or `url`: a balancer's) and its way to Redis."""
        node = self.nodes[i]
        return Server(url or node.url, self.key, self.secret, f"{node.host_ip}:{self.redis_port}")

    def host_of(self, room: str) -> int:
        """Which node (from 0) hosts `room`: the servers' own map in Redis (`room_node_map`, node id -> the
        node's record, which holds its address)."""
        import redis

        r = redis.Redis(port=self.redis_port)
        try:
            node_id = r.hget("room_node_map", room)
            record = r.hget("nodes", node_id) if node_id else None
        finally:
            r.close()
        for i, node in enumerate(self.nodes):
            if record and node.ip.encode() in record:
                return i
        raise AssertionError(f"no node hosts room {room!r}")

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.down()
        if self.redis_proc is not None:
            self.redis_proc.kill()
            self.redis_proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait_port(host: str, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {host}:{port}")


class Balancer:
    """A TCP proxy on 127.0.0.1 that hands each connection to the first of `upstreams` ((host, port)) that
    accepts it: a load balancer's health check, as simple as it gets. Runs on the caller's event loop."""

    def __init__(self, upstreams: list[tuple[str, int]]) -> None:
        self.upstreams = upstreams
        self.picked: list[tuple[str, int]] = []  # where each connection went

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"ws://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for host, port in self.upstreams:
            try:
                up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
            except (OSError, TimeoutError):
                continue
            self.picked.append((host, port))
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer), return_exceptions=True)
            return
        writer.close()

    async def close(self) -> None:
        self.server.close()
        with contextlib.suppress(Exception):  # closing a proxy whose peers are gone
            await self.server.wait_closed()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    finally:
        with contextlib.suppress(Exception):  # closing a proxy whose peers are gone
            dst.close()
