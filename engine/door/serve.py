"""The engine in a process of its own: `python -m engine.door.serve`, started by the worker
(engine/client/process.py `EngineProcess`).

The process builds the engine from the config in its environment (`CHORUS_ENGINE_CONFIG`, an `EngineConfig`
as JSON), reads the door's two keys from the first line of its standard input (engine/transport/wire.py
DoorKeys: the worker's key is in no environment), opens its door (engine/door/host.py) at
`CHORUS_ENGINE_SOCKET`, prints one line when rooms may connect and runs until its standard input closes (the
worker ended, however it ended) or it is told to stop. Every room, the worker's own questions (admission,
load) included, reaches it only through that door, so no room's Python ever runs in the interpreter of the
tick. A door whose thread stopped is an engine no room can reach: the process then exits with DOOR_STOPPED,
as if the engine had died. Knows the engine and its door; nothing of LiveKit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading

from engine.transport.wire import ADDRESS_ENV, CONFIG_ENV, READY, DoorKeys

log = logging.getLogger("chorus.engine.serve")

DOOR_STOPPED = 3  # the exit status of an engine whose door stopped


def main() -> int:
    from engine.config.engine_config import EngineConfig
    from engine.door.host import EngineHost
    from engine.observe.spans import start_spans
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
    spans = start_spans(engine, config.traces)  # the sessions' spans, off the tick; None when untraced
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
        if spans is not None:
            spans.close()
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


if __name__ == "__main__":
    sys.exit(main())
