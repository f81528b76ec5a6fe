"""The wire format of the engine's door (engine/host.py) and of what reaches it (engine/remote.py): one JSON
object a line on a Unix socket in the abstract namespace, an event as its type's name and fields, an engine
error as its class's name and message. Knows sockets, JSON and the engine's wire types (`engine.api`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import typing
from typing import Any

from engine import api
from engine.api import EngineClosed, EngineError, Output

ADDRESS_ENV = "CHORUS_ENGINE_SOCKET"  # where a room's process finds the engine (set by the worker)
MAX_LINE = 4 << 20  # one message: a tool's result is cut to the engine's max_result_chars after this
EVENTS = {cls.__name__: cls for cls in typing.get_args(api.Event)}  # every output but audio frames


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def event_message(seq: int, frames_before: int, item: Output) -> dict[str, Any]:
    """An output other than audio, numbered, with the frames written before it (`decode_event` reads it)."""
    return {
        "op": "event",
        "seq": seq,
        "frames": frames_before,
        "type": type(item).__name__,
        "fields": dataclasses.asdict(item),
    }


def decode_event(msg: dict[str, Any]) -> Output | None:
    cls = EVENTS.get(msg.get("type"))
    fields = msg.get("fields")
    if cls is None or not isinstance(fields, dict):
        return None
    try:
        return cls(**fields)
    except TypeError:
        return None


def error_message(e: EngineError, kind: str | None = None) -> dict[str, Any]:
    """The engine's refusal as the room raises it again (`raise_error`)."""
    return {"op": "error", "kind": kind or type(e).__name__, "message": str(e)}


def raise_error(reply: dict[str, Any]) -> None:
    """An `error` answer as the EngineError the engine raised (EngineError itself for a kind not known)."""
    if reply.get("op") == "error":
        cls = getattr(api, str(reply.get("kind")), None)
        cls = cls if isinstance(cls, type) and issubclass(cls, EngineError) else EngineError
        raise cls(str(reply.get("message", "")))


def connect(address: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + address)
    except OSError as e:
        sock.close()
        raise EngineClosed(f"the engine is not reachable ({e.strerror or e})") from None
    return sock


def read_line(sock: socket.socket, buf: bytearray) -> dict[str, Any]:
    """The next message on a blocking socket (what is past it stays in `buf`); EngineClosed when none comes
    within the socket's timeout or the engine closes it."""
    while b"\n" not in buf:
        if len(buf) > MAX_LINE:
            raise EngineClosed("the engine sent a message longer than the limit")
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise EngineClosed(f"the engine did not answer within {sock.gettimeout():.0f} s") from None
        if not data:
            raise EngineClosed("the engine closed the connection")
        buf += data
    end = buf.index(b"\n")
    line = bytes(buf[:end])
    del buf[: end + 1]
    return json.loads(line)
