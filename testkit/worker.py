"""The worker as a user runs it (`python -m agent start`, a subprocess) against a LiveKit server: tiny preset,
CPU, its own agent name, SQLite store and ports; what it shows on its /snapshot and /worker endpoints, and the
hotel it books in. Knows nothing of the callers in its rooms.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from agent.call import room_label
from testkit.server import ROOT, Server


def free_port() -> int:
    """A TCP port free now, below the kernel's ephemeral range: a port the kernel handed out (bind to 0) may
    be given again to any outgoing connection (a caller's, the server's) before the worker binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def get_json(url: str, timeout: float = 10.0) -> dict:
    """A worker's JSON endpoint (its engine's snapshot, livekit-agents' worker info). The bound is for a
    worker that stopped answering, not a measure: on a starved machine (16 rooms, the server, the callers and
    another process on 2 cores) the worker's own loop answered later than 2 s."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def http_exchange(port: int, request: bytes, timeout: float, source: str | None = None) -> bytes:
    """All that a server on 127.0.0.1:`port` (an endpoint such as /snapshot) answers to `request`: sent on a
    new connection, from the address `source` when given, and read until the server closes it. `timeout`
    bounds each socket call; a failed one raises OSError."""
    with socket.create_connection(
        ("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None
    ) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def seeded(tmp: Path) -> None:
    """A seeded SQLite hotel in `tmp`, as `python -m tools seed` leaves it, as this process's CHORUS_DATA_DIR
    (a Worker started afterwards books in it)."""
    os.environ["CHORUS_DATA_DIR"] = str(tmp)
    from tools.seed import seed
    from tools.store import open_store

    with open_store() as store:
        seed(store, dt.date.today())


class Worker:
    """`python -m agent start` against `server`: tiny preset, its own agent name, SQLite store and ports. Its
    output goes to `log`; `snapshot()` reads the engine's /snapshot and `info()` the worker's /worker."""

    def __init__(
        self,
        server: Server,
        tmp: Path,
        *,
        slots: int = 4,
        name: str | None = None,
        netns: str | None = None,
        **env: str,
    ):
        self.server, self.slots = server, slots
        self.netns = netns  # a host of a cluster (testkit/nodes.py): its snapshot is not reachable
        self.agent_name = name or f"chorus-test-{uuid.uuid4().hex[:8]}"
        self.metrics_port = free_port()
        self.http_port = next(p for p in iter(free_port, None) if p != self.metrics_port)
        self.log = tmp / f"worker-{self.agent_name}-{self.http_port}.log"
        self.env = {
            **os.environ,
            "LIVEKIT_URL": server.url,
            "LIVEKIT_API_KEY": server.key,
            "LIVEKIT_API_SECRET": server.secret,
            "LIVEKIT_AGENT_NAME": self.agent_name,
            "CHORUS_PRESET": "tiny",
            "CHORUS_DEVICE": "cpu",
            "CHORUS_SLOTS": str(slots),
            "CHORUS_METRICS_PORT": str(self.metrics_port),
            "CHORUS_HTTP_PORT": str(self.http_port),
            "CHORUS_DATA_DIR": str(tmp),
            "CHORUS_TEACHER_FORCING": "true",
            # the tests are of behaviour on a shared 2-core machine that also runs the server and the callers;
            # capacity is the benchmarks' to measure
            "CHORUS_REFUSE_WHEN_OVERLOADED": "false",
            # the server's own Redis, where the workers mark the rooms they serve (agent/fleet/fleet.py)
            **server.redis_env(),
            **env,
        }
        self.env.pop("DATABASE_URL", None)
        self.proc: subprocess.Popen | None = None

    def launch(self) -> Worker:
        """Start the worker's process (once) without waiting: workers launched together start at once."""
        if self.proc is None:
            self._out = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
            prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "agent", "start"],
                cwd=ROOT,
                env=self.env,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def start(self, timeout: float = 120.0) -> Worker:
        """Launch the worker if it is not yet, and wait until it has registered with the server."""
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError, ValueError):
                if not self.netns:
                    self.snapshot()
                if b"registered worker" in self.log.read_bytes():
                    return self
            time.sleep(0.2)
        raise AssertionError(f"the worker did not register within {timeout:.0f} s:\n{self.tail()}")

    def snapshot(self) -> dict:
        return get_json(f"http://127.0.0.1:{self.metrics_port}/snapshot")

    def info(self) -> dict:
        return get_json(f"http://127.0.0.1:{self.http_port}/worker")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if hasattr(self, "_out"):
            self._out.close()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SessionsByRoom(dict):
    """A snapshot's sessions by their label, looked up by room name: the worker shows a room by its label, a
    pseudonym of its name (agent/call.py, `room_label`), so a name is looked up by its label."""

    def __getitem__(self, room: str) -> dict:
        return super().__getitem__(room_label(room))

    def get(self, room: str, default=None):
        return super().get(room_label(room), default)

    def __contains__(self, room: object) -> bool:
        return super().__contains__(room_label(room) if isinstance(room, str) else room)


def sessions_by_label(snapshot: dict) -> SessionsByRoom:
    return SessionsByRoom({s["label"]: s for s in snapshot["sessions"]})
