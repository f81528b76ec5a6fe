"""The worker's handle on its engine's process (engine/door/serve.py, `python -m engine.door.serve`): started
with the engine's config in its environment and the door's two keys down a pipe, waited for until it says it
is ready, stopped. Imports nothing of the engine's own side: the worker's process stays free of torch until
it runs the engine itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid

from engine.api import EngineClosed
from engine.transport.wire import ADDRESS_ENV, CONFIG_ENV, KEY_ENV, READY, DoorKeys


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
