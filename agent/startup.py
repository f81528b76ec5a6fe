"""What a worker's start needs from its host and what happens when its start fails: the ports its settings
name are free (checked before anything starts), its health port when none is set, and a start that fails
anyway ending the process with one line and a non-zero exit status. Knows the settings and sockets, not the
engine or the calls.

livekit-agents' CLI logs a worker whose `run` raised ("worker failed"), drains it and exits 0: a supervisor
that restarts a failed worker would leave it down, and the drain of a worker that never started fails again.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from livekit.agents import AgentServer

    from agent.settings import AgentSettings

__all__ = ["HEALTH_PORTS", "exit_on_failed_start", "free_health_port", "listen_problem", "port_problem"]

HEALTH_PORTS = range(8081, 8100)  # the worker's health port: livekit-agents' 8081, or the next free one
EXIT_FAILED_START = 1


def listen_problem(port: int, host: str) -> str | None:
    """Why `port` cannot be listened on at `host` ("" for every interface), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use"
            return f"port {port} cannot be listened on ({e.strerror or type(e).__name__})"
    return None


def port_problem(settings: AgentSettings) -> str | None:
    """`NAME: port N is in use` (or cannot be listened on, or is another setting's too) for the first port
    setting the worker could not listen on, or None: checked before the engine starts, which takes seconds to
    minutes, and before livekit-agents' CLI, which would exit 0 on it. Port 0 (any free port) is never a
    problem."""
    ports = [
        ("CHORUS_HTTP_PORT", settings.http_port, ""),  # livekit-agents' servers: every interface
        ("CHORUS_PROMETHEUS_PORT", settings.prometheus_port, ""),
        ("CHORUS_METRICS_PORT", settings.metrics_port, "127.0.0.1"),  # the engine's snapshot server
    ]
    ports = [(name, port, host) for name, port, host in ports if port]
    taken: dict[int, str] = {}
    for name, port, _ in ports:  # first the settings themselves: two servers on one port
        if port in taken:
            return f"{name}: port {port} is {taken[port]} too"
        taken[port] = name
    for name, port, host in ports:
        if problem := listen_problem(port, host):
            return f"{name}: {problem}"
    return None


def free_health_port(ports: range = HEALTH_PORTS) -> int:
    """The first of `ports` that no process listens on and no other worker of this host has taken (0, any free
    port, if none is): a second worker on a host (one per GPU) starts with no port of its own set, and a
    supervisor finds each worker's health endpoint at a predictable place, 8081 for the first. A port is
    taken with a lock file held for the life of this process, so two workers starting together, between
    this choice and their servers' binding, never choose the same one."""
    for port in ports:
        lock = Path(tempfile.gettempdir()) / f"chorus-worker-port-{port}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if listen_problem(port, ""):
            os.close(fd)
            continue
        _port_locks.append(fd)
        return port
    return 0


_port_locks: list[int] = []  # the health ports this process took (`free_health_port`)


def _exit_failed_start() -> None:
    raise SystemExit(EXIT_FAILED_START)


def exit_on_failed_start(server: AgentServer) -> None:
    """Make `server` end the process when its `run` fails before the worker started (its servers listening,
    its job processes' pool running): one line on stderr, `chorus worker: cannot start (...)`, and exit
    status 1, whichever CLI runs it. The exit is a SystemExit raised on the worker's event loop, which
    livekit-agents' CLI does not catch: its drain and close, which need a started worker, are skipped; the
    engine's process ends with this one (agent/worker.py `close_shared`, at exit). A worker that fails after
    it started is logged, drained and closed by the CLI as before, and `failed` is set: `python -m agent
    start` then exits 1."""
    run = server.run
    started = False

    def on_started(*_: Any) -> None:
        nonlocal started
        started = True

    async def run_or_exit(*, devmode: bool = False, unregistered: bool = False) -> None:
        try:
            await run(devmode=devmode, unregistered=unregistered)
        except Exception as e:
            server.failed = True  # type: ignore[attr-defined]
            if started:
                raise
            text = str(e).strip()
            reason = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
            print(f"chorus worker: cannot start ({reason})", file=sys.stderr, flush=True)
            # raised by the loop itself, not by this task: no task is left holding an exit never retrieved
            asyncio.get_running_loop().call_soon(_exit_failed_start)

    server.failed = False  # type: ignore[attr-defined]
    server.on("worker_started", on_started)
    server.run = run_or_exit  # type: ignore[method-assign]
