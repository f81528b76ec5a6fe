"""The engine in a process of its own: `python -m engine.door.serve`, started by the worker (`EngineProcess`).

The process builds the engine from the config in its environment (`CHORUS_ENGINE_CONFIG`, an `EngineConfig`
as JSON), reads the door's two keys from the first line of its standard input (engine/client/wire.py DoorKeys:
the worker's key is in no environment), opens its door (engine/door/host.py) at `CHORUS_ENGINE_SOCKET`, prints
one line when rooms may connect and runs until its standard input closes (the worker ended, however it ended)
or it is told to stop. Every room, the worker's own questions (admission, load) included, reaches it only
through that door, so no room's Python ever runs in the interpreter of the tick. A door whose thread stopped
is an engine no room can reach: the process then exits with DOOR_STOPPED, as if the engine had died. Knows the
engine and its door; nothing of LiveKit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

from engine.api import EngineClosed
from engine.client.wire import ADDRESS_ENV, KEY_ENV, DoorKeys

log = logging.getLogger("chorus.engine.serve")

CONFIG_ENV = "CHORUS_ENGINE_CONFIG"
READY = "chorus engine ready"
DOOR_STOPPED = 3  # the exit status of an engine whose door stopped


def main() -> int:
    from engine.door.host import EngineHost
    from engine.sizing.engine_config import EngineConfig
    from engine.tick.engine import Engine

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    config = EngineConfig.model_validate_json(os.environ[CONFIG_ENV])
    keys = DoorKeys(**json.loads(_first_line(0)))
    engine = Engine(config)
    host = EngineHost(engine, os.environ[ADDRESS_ENV], keys).start()
    print(READY, flush=True)

    # the worker holds our standard input: its end is ours, however the worker ended (even by SIGKILL, the
    # kernel closes the pipe); a death signal would not do, it follows the thread that started us
    def watch_parent() -> None:  # unbuffered: no lock of the interpreter's is held in it at exit
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        stop.set()

    threading.Thread(target=watch_parent, name="chorus-parent", daemon=True).start()
    try:
        return run_until_stopped(host, stop)
    finally:
        host.close()
        engine.close()


def _first_line(fd: int, limit: int = 4096) -> bytes:
    """The first line on `fd`, read a byte at a time so that nothing after it is taken."""
    line = bytearray()
    while len(line) < limit and (b := os.read(fd, 1)) and b != b"\n":
        line += b
    return bytes(line)


def run_until_stopped(host, stop: threading.Event, every_s: float = 0.5) -> int:
    """Wait for `stop`; the exit status: 0, or DOOR_STOPPED as soon as the door's thread is found stopped."""
    while not stop.wait(every_s):
        if not host.alive:
            log.error("the engine's door stopped: the engine exits, so that its worker starts another")
            return DOOR_STOPPED
    return 0


class EngineProcess:
    """The worker's handle on its engine's process: `start` launches `python -m engine.door.serve` with
    `config` (an EngineConfig as JSON) and waits for it to be ready (EngineClosed with its last words if it
    exits or takes longer than `timeout`); `address` is its door; `stop` ends it."""

    def __init__(self, config_json: str, *, timeout: float) -> None:
        self.address = f"chorus-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.keys = DoorKeys.fresh()
        self.config_json, self.timeout = config_json, timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> EngineProcess:
        # the rooms' key is in the environment the rooms inherit; the worker's goes down the pipe only
        env = {**os.environ, CONFIG_ENV: self.config_json, ADDRESS_ENV: self.address, KEY_ENV: self.keys.room}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.door.serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        keys = {"room": self.keys.room, "control": self.keys.control}
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps(keys) + "\n")
            self.proc.stdin.flush()
        lines: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line.rstrip())
                if line.strip() == READY:
                    ready.set()
            ready.set()

        ready = threading.Event()
        threading.Thread(target=read, name="chorus-engine-stdout", daemon=True).start()
        t0 = time.monotonic()
        if not ready.wait(self.timeout) or READY not in lines:
            code = self.proc.poll()
            self.stop()
            why = (
                f"exited with status {code}"
                if code is not None
                else f"not ready in {time.monotonic() - t0:.0f} s"
            )
            raise EngineClosed(f"the engine's process {why} (its log is the worker's)")
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
