"""The snapshot endpoint's own process: HTTP for `/snapshot`, `/metrics` and `/healthz`, away from
the engine's GIL.

`engine.observe.metrics.SnapshotServer` starts it as `python engine/observe/snapshot_serve.py LIMITS HOST
PORT` (LIMITS: the JSON of `ServeLimits`). It prints the port it listens on, then asks its parent for the
bytes of an answer over the pipe (one byte on stdout: "s" the snapshot, "m" the Prometheus text) at most once
per `interval_s` each, and gives every request meanwhile the bytes it has. It exits when the parent closes the
pipe. The monitoring page's requests come from 127.0.0.1 (`lane`: on the worker's machine, or through an SSH
tunnel) and are served in a lane of their own, their own turns and places, so no crowd of other addresses
keeps the page waiting. Standard library only: it starts in a few tens of milliseconds, at a lower CPU
priority than the engine, and knows nothing of it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass
from http import HTTPStatus


@dataclass(frozen=True)
class ServeLimits:
    """What the endpoint allows. The engine's process builds at most one answer of each kind per `interval_s`
    whatever the requests; what they cost the machine's cores (this process's) is bounded here."""

    interval_s: float = 0.5  # the snapshot and the Prometheus text are built at most this often
    head_s: float = 2.0  # a connection has this long to send its request line and headers, or is closed
    timeout_s: float = 3.0  # ...and this long in all to take its answer
    client_rate: float = 20.0  # requests per second one client address may make; 429 beyond
    client_burst: int = 40
    max_rate: float = 50.0  # requests answered per second in all; the rest wait their turn, within timeout_s
    max_burst: int = 32  # ...and at once
    # connections open at once, in all and from one address: one more takes the place of the oldest
    # connection (of that address) that has not sent its request yet, or is closed at once if there is none
    max_connections: int = 256
    client_connections: int = 4
    max_clients: int = 1024  # client addresses whose rate is remembered (the least recent forgotten)
    # the address whose requests have turns (`max_rate`, `max_burst`) and places (`client_connections`) of
    # their own, beside the others': the monitoring page's, which polls from it ("": no such lane)
    lane: str = "127.0.0.1"
    nice: int = 10  # added to this process's nice value: the engine's threads come first on a busy machine

    def to_json(self) -> str:
        return json.dumps(asdict(self))


PATHS = {"/snapshot": b"s", "/metrics": b"m", "/healthz": None}
KINDS = {b"s": "application/json", b"m": "text/plain; version=0.0.4"}
FRAME_HEAD = 6  # a frame from the parent: kind (1 byte), ok (b"1" or b"0"), length (4 bytes, big-endian)
MAX_HEAD = 8192  # bytes of a request's line and headers


def response(
    status: int,
    body: bytes = b"",
    kind: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    extra: str = "",
) -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode() + (b"" if head_only else body)


class ClientRate:
    """A token bucket per client address: `rate` requests per second, `burst` at once."""

    def __init__(self, rate: float, burst: int, max_clients: int) -> None:
        self._rate, self._burst, self._max = rate, burst, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, when)

    def allow(self, client: str, now: float) -> bool:
        tokens, at = self._buckets.pop(client, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - at) * self._rate)
        ok = tokens >= 1.0
        self._buckets[client] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return ok


class TurnRate:
    """Turns `rate` a second, `burst` at once: `wait(now)` takes the next turn and says how long until it is
    due (a token bucket that lends: every caller gets a turn, the later ones later)."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate, self._burst = rate, float(burst)
        self._tokens, self._at = float(burst), 0.0

    def wait(self, now: float) -> float:
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate) - 1.0
        self._at = now
        return max(0.0, -self._tokens / self._rate)


class Endpoint:
    """The listening socket, the connections and the bytes of the answers, on one asyncio loop.

    A connection holds a place from its acceptance to its close. While it has not sent its whole request (at
    most `head_s`) it is *idle*: it costs nothing but its place, takes no turn, and gives its place up to a
    newer connection when the places are all taken (of its address's, or in all). So idle connections, from
    however many addresses, delay nobody: a client's request is read as soon as it arrives, and only
    requests read whole wait for their turn (`max_rate`) and for the answer's bytes. The `lane` address's
    connections hold places of their own (its `client_connections`, never counted in `max_connections` nor
    closed for another address's) and take turns of their own: requests of other addresses, however many,
    never queue before its."""

    def __init__(self, limits: ServeLimits, sock: socket.socket) -> None:
        self.limits = limits
        self.sock = sock
        self.rate = ClientRate(limits.client_rate, limits.client_burst, limits.max_clients)
        self.bytes: dict[bytes, bytes] = {}  # kind -> the latest answer
        self.at: dict[bytes, float] = {}  # kind -> when it came
        self.pending: dict[bytes, asyncio.Future] = {}  # kind -> the parent's answer being waited for
        self.open: dict[str, int] = {}  # client address -> its connections open now
        self.places: dict[asyncio.Task, str] = {}  # each open connection's task -> its client address
        self.idle: OrderedDict[asyncio.Task, str] = OrderedDict()  # those not read whole yet, oldest first
        self.turns = TurnRate(limits.max_rate, limits.max_burst)
        self.lane_turns = TurnRate(limits.max_rate, limits.max_burst)

    async def run(self) -> None:
        """Serve until the parent closes the pipe."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
        accept = loop.create_task(self.accept())
        try:
            while True:
                head = await reader.readexactly(FRAME_HEAD)
                body = await reader.readexactly(int.from_bytes(head[2:], "big"))
                self.arrived(head[:1], head[1:2] == b"1", body)
        except asyncio.IncompleteReadError:
            pass  # the parent is gone (closed, or exited)
        finally:
            accept.cancel()

    async def answer_bytes(self, kind: bytes) -> bytes | None:
        """The bytes of `kind`: those at hand while fresh, else the parent's next ones (one question at a
        time, whoever else waits); None if the parent could not make them or did not answer in time."""
        loop = asyncio.get_running_loop()
        if kind in self.bytes and loop.time() - self.at[kind] < self.limits.interval_s:
            return self.bytes[kind]
        future = self.pending.get(kind)
        if future is None:
            future = self.pending[kind] = loop.create_future()
            os.write(1, kind)
        return await asyncio.shield(future)

    def arrived(self, kind: bytes, ok: bool, body: bytes) -> None:
        if ok:
            self.bytes[kind], self.at[kind] = body, asyncio.get_running_loop().time()
        future = self.pending.pop(kind, None)
        if future is not None and not future.done():
            future.set_result(body if ok else None)

    async def accept(self) -> None:
        """Accept every connection as it comes, so that the listen backlog never fills and shuts out the
        clients behind it, and give it a place: its address's `client_connections` and `max_connections` in
        all, taken from the oldest idle connection (of that address) when they are full; with no idle one to
        take it from, it is closed at once, unanswered."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError:  # gone before it was accepted, or no file left for it: the next one
                await asyncio.sleep(0.01)
                continue
            client = addr[0]
            if self.room_for(client):
                task = loop.create_task(self.serve(conn, client))
                task.add_done_callback(functools.partial(self.finished, conn))
                self.places[task] = self.idle[task] = client
                self.open[client] = self.open.get(client, 0) + 1
            else:
                conn.close()
            await asyncio.sleep(0)  # the connections accepted so far read their requests between two accepts

    def room_for(self, client: str) -> bool:
        """A place for one more connection of `client`: free, or made by closing an idle one."""
        lim = self.limits
        if self.open.get(client, 0) >= lim.client_connections and not self.evict(client):
            return False
        if client == lim.lane:
            return True  # its places are its own
        shared = len(self.places) - self.open.get(lim.lane, 0)
        return shared < lim.max_connections or self.evict()

    def evict(self, client: str | None = None) -> bool:
        """Close the oldest idle connection (of `client`, or of anyone but the lane's); False if there is
        none."""
        lane = self.limits.lane
        task = next((t for t, c in self.idle.items() if c == client or (client is None and c != lane)), None)
        if task is None:
            return False
        task.cancel()  # its socket is closed once it has stopped (`finished`); its place is free now
        self.release(task)
        return True

    def finished(self, conn: socket.socket, task: asyncio.Task) -> None:
        """`task`, serving `conn`, has ended (answered, timed out, gone, or evicted): the socket is closed."""
        conn.close()
        self.release(task)

    def release(self, task: asyncio.Task) -> None:
        """`task`'s connection gives up its place (once; again is nothing)."""
        client = self.places.pop(task, None)
        if client is None:
            return
        self.idle.pop(task, None)
        held = self.open.pop(client) - 1
        if held:
            self.open[client] = held

    async def serve(self, conn: socket.socket, client: str) -> None:
        loop, lim = asyncio.get_running_loop(), self.limits
        task = asyncio.current_task()
        try:
            async with asyncio.timeout(lim.timeout_s):
                async with asyncio.timeout(lim.head_s):
                    head = b""
                    while b"\r\n\r\n" not in head and b"\n\n" not in head:
                        if len(head) > MAX_HEAD:
                            await loop.sock_sendall(conn, response(431, b"request too large\n"))
                            return
                        chunk = await loop.sock_recv(conn, 4096)
                        if not chunk:
                            return
                        head += chunk
                self.idle.pop(task, None)  # read whole: its place is its own until it is answered
                if not self.rate.allow(client, loop.time()):
                    body = response(429, b"too many requests\n", extra="Retry-After: 1\r\n")
                else:
                    turns = self.lane_turns if client == lim.lane else self.turns
                    await asyncio.sleep(turns.wait(loop.time()))
                    body = await self.answer(head)
                await loop.sock_sendall(conn, body)
        except (TimeoutError, OSError):
            pass  # an idle or vanished client: nothing to answer

    async def answer(self, head: bytes) -> bytes:
        parts = head.split(b"\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return response(400, b"bad request\n")
        method, path = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return response(405, b"GET or HEAD only\n", extra="Allow: GET, HEAD\r\n")
        if path not in PATHS:
            return response(404, f"not found: try {', '.join(PATHS)}\n".encode())
        kind = PATHS[path]
        if kind is None:
            return response(200, b"ok\n", head_only=method == "HEAD")
        body = await self.answer_bytes(kind)
        if body is None:
            return response(500, b"the engine could not describe itself\n")
        return response(200, body, KINDS[kind], head_only=method == "HEAD")


def main(argv: list[str]) -> int:
    limits = ServeLimits(**json.loads(argv[0]))
    # a terminal's Ctrl-C is the parent's to handle; the parent then closes the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if limits.nice:
        os.nice(limits.nice)
    try:
        sock = socket.create_server((argv[1], int(argv[2])), backlog=128)
    except OSError as e:
        print(f"snapshot endpoint: cannot listen on {argv[1]}:{argv[2]}: {e}", file=sys.stderr)
        return 1
    sock.setblocking(False)
    os.write(1, f"{sock.getsockname()[1]}\n".encode())
    asyncio.run(Endpoint(limits, sock).run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
