"""The wire format of the engine's door (engine/door/host.py) and of what reaches it
(engine/client/remote.py): how the engine's process is started (its environment, its ready line), one JSON
object a line on a Unix socket in the abstract namespace, an event as its type's name and fields, an engine
error as its class's name and message. Knows sockets, JSON and the engine's wire types (`engine.api`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import socket
import struct
import time
import typing
from typing import Any

from engine import api
from engine.api import (
    Admit,
    AskLoad,
    Control,
    Drain,
    EngineClosed,
    EngineError,
    ForceTokens,
    KeepPrivate,
    Output,
    PadBetween,
    Release,
    ReportFleet,
    Request,
    SubmitResult,
)

ADDRESS_ENV = "CHORUS_ENGINE_SOCKET"  # where a room's process finds the engine (set by the worker)
KEY_ENV = "CHORUS_ENGINE_KEY"  # the rooms' key to the door (set by the worker for its rooms; never logged)
CONFIG_ENV = (
    "CHORUS_ENGINE_CONFIG"  # the engine's config as JSON (set by engine/client/process.py for its engine)
)
READY = "chorus engine ready"  # the line the engine's process prints once its door is open
MAX_LINE = 4 << 20  # one message: a tool's result is cut to the engine's max_result_chars after this
MAX_DEPTH = (
    16  # arrays and objects inside one another in a message (the deepest the door sends or takes is 4)
)
MAX_TOKENS = 1 << 16  # brackets and strings in one message, past the first MAX_DEPTH brackets
CONNECT_RETRY_S = 0.01  # a door whose queue of connections is full (EAGAIN) is tried again this often
EVENTS = {cls.__name__: cls for cls in typing.get_args(api.Event)}  # every output but audio frames
# a room's requests of its own session, by the operation each crosses the door as
REQUESTS: dict[str, type] = {
    "result": SubmitResult,
    "force": ForceTokens,
    "pad_between": PadBetween,
    "private": KeepPrivate,
}
# the worker's requests of its engine, by operation
CONTROLS: dict[str, type] = {
    "admit": Admit,
    "release": Release,
    "load": AskLoad,
    "drain": Drain,
    "fleet": ReportFleet,
}
OPS = {cls: op for op, cls in (*REQUESTS.items(), *CONTROLS.items())}
JOB_MAX = 200  # characters in the name of a job an admission is for
# a session's own part of its prompt (`open`'s context): the largest a carried call makes
# (agent/fleet/carry.py: 24 turns of 600 characters, 12 tool calls of up to 3,000, the template) is about
# 53,000 characters, some 15,000 positions with the release's tokenizer and 29,000 with the tiny preset's
# (1.8 characters a token); each position is prefilled in the slot's slack, 64 a tick, so the caps leave room
# for that and no more
MAX_CONTEXT_CHARS = 65_536
MAX_CONTEXT_TOKENS = 32_768
REASONS_MAX = 8  # reasons in the fleet's counts
FORCE_MAX = 4096  # teacher-forced tokens in one request
PRIVATE_MAX = 64  # terms kept private in one request (more are dropped)
# a session's trace context (`open`'s trace): a W3C traceparent, version 00, lowercase hex
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


@dataclasses.dataclass(frozen=True)
class DoorKeys:
    """The two keys to the engine's door: `room` (a room's process: hello, open, its own session) and
    `control` (the worker: admission, release, load, drain). Made fresh for each engine; the repr shows
    neither."""

    room: str = dataclasses.field(repr=False)
    control: str = dataclasses.field(repr=False)

    @classmethod
    def fresh(cls) -> DoorKeys:
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))


# a JSON string (escapes included) or one bracket: what `shape_error` walks
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def shape_error(line: bytes) -> str | None:
    """Why a message may not be parsed (too long, nested deeper than MAX_DEPTH, too many parts to walk), or
    None. Cheap for every message: only one with more than MAX_DEPTH brackets is walked, and that walk
    stops after MAX_TOKENS parts (json.loads itself would recurse once per level)."""
    if len(line) > MAX_LINE:
        return "a message longer than the limit"
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return None
    depth = 0
    for n, m in enumerate(_TOKEN.finditer(line)):
        if n >= MAX_TOKENS:
            return f"a message of more than {MAX_TOKENS} parts"
        c = m.group()
        if c == b"[" or c == b"{":
            depth += 1
            if depth > MAX_DEPTH:
                return f"a message nested deeper than {MAX_DEPTH}"
        elif c == b"]" or c == b"}":
            depth -= 1
    return None


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (the kernel's SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


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


def request_message(request: Request, session: str) -> dict[str, Any]:
    """A room's request of its session `session`, as it crosses the door (`decode_request` reads it)."""
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(request).items()}
    return {"op": OPS[type(request)], **fields, "session": session}


def decode_request(op: str, msg: dict[str, Any]) -> Request:
    """The request a message names (`request_message`'s); ValueError, saying what is wrong, for a malformed
    one or an operation that is no request."""
    if op == "result":
        call_id, output = msg.get("call_id"), msg.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise ValueError("result: call_id and output must be strings")
        return SubmitResult(call_id, output, bool(msg.get("is_error", False)))
    if op == "force":
        ids = msg.get("ids")
        if not isinstance(ids, list) or len(ids) > FORCE_MAX or not all(type(i) is int for i in ids):
            raise ValueError(f"force: ids must be a list of at most {FORCE_MAX} integers")
        if msg.get("channel") not in ("text", "function"):
            raise ValueError("force: channel must be text or function")
        return ForceTokens(msg["channel"], tuple(ids))
    if op == "pad_between":
        if not isinstance(msg.get("on"), bool):
            raise ValueError("pad_between: on must be true or false")
        return PadBetween(msg["on"])
    if op == "private":
        terms = msg.get("terms")
        if not isinstance(terms, list) or not all(isinstance(t, str) for t in terms):
            raise ValueError("private: terms must be a list of strings")
        return KeepPrivate(tuple(terms[:PRIVATE_MAX]))
    raise ValueError(f"unknown operation {op[:40]!r}")


def control_message(request: Control) -> dict[str, Any]:
    """The worker's request of its engine, as it crosses the door (`decode_control` reads it)."""
    return {"op": OPS[type(request)], **dataclasses.asdict(request)}


def decode_control(op: str, msg: dict[str, Any]) -> Control:
    """The worker's request a message names (`control_message`'s); ValueError, saying what is wrong, for a
    malformed one or an operation that is none of the worker's."""
    if op in ("admit", "release"):
        job = msg.get("admission")
        if not isinstance(job, str) or not 0 < len(job) <= JOB_MAX:
            raise ValueError(f"{op}: admission must name a job")
        return Admit(job) if op == "admit" else Release(job)
    if op == "load":
        figures = msg.get("figures", False)
        if not isinstance(figures, bool):
            raise ValueError("load: figures must be true or false")
        return AskLoad(figures)
    if op == "drain":
        seconds = msg.get("seconds")
        if type(seconds) not in (int, float) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError("drain: seconds must be a number of seconds")
        return Drain(float(seconds))
    if op == "fleet":
        counts = msg.get("redispatches")
        if (
            not isinstance(counts, dict)
            or len(counts) > REASONS_MAX
            or not all(_a_count(k, v) for k, v in counts.items())
        ):
            raise ValueError("fleet: redispatches must be a few counts by reason")
        return ReportFleet(dict(counts))
    raise ValueError(f"unknown operation {op[:40]!r}")


def _a_count(reason: object, n: object) -> bool:
    """One of the fleet's counts: a short reason and a whole number of new agents."""
    return isinstance(reason, str) and len(reason) <= 40 and type(n) is int and n >= 0


def context_error(context: str) -> str | None:
    """Why a session's context is refused for its length in characters (the door counts its tokens too), or
    None."""
    if len(context) > MAX_CONTEXT_CHARS:
        return (
            f"context: {len(context):,} characters, more than the {MAX_CONTEXT_CHARS:,} a session's own part "
            "of its prompt may have"
        )
    return None


def trace_error(trace: object) -> str | None:
    """Why a session's trace context is refused (not a W3C traceparent `00-<32 hex>-<16 hex>-<2 hex>` in
    lowercase, or one whose trace or span id is all zeros), or None; "" is no trace."""
    if trace == "":
        return None
    m = TRACEPARENT.fullmatch(trace) if isinstance(trace, str) else None
    if m is None or not int(m[1], 16) or not int(m[2], 16):
        return "trace: a W3C traceparent (00-<32 hex digits>-<16 hex digits>-<2 hex digits>) or nothing"
    return None


def trace_id(trace: str) -> str:
    """The trace id (32 hex digits) of a traceparent `trace_error` took, "" for none."""
    return trace[3:35]


def error_message(e: EngineError, kind: str | None = None) -> dict[str, Any]:
    """The engine's refusal as the room raises it again (`raise_error`)."""
    return {"op": "error", "kind": kind or type(e).__name__, "message": str(e)}


def raise_error(reply: dict[str, Any]) -> None:
    """An `error` answer as the EngineError the engine raised (EngineError itself for a kind not known)."""
    if reply.get("op") == "error":
        cls = getattr(api, str(reply.get("kind")), None)
        cls = cls if isinstance(cls, type) and issubclass(cls, EngineError) else EngineError
        raise cls(str(reply.get("message", "")))


def connect(address: str, timeout: float, key: str) -> socket.socket:
    """A connection to the door at `address`, its first line the key (sent at once: the door reads it as it
    accepts). The door must be this user's (the kernel's credentials of the listening process): a socket of
    the same name made by another user is not the engine. A door whose queue of connections is full is
    tried again until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + address)
            break
        except BlockingIOError:  # EAGAIN: the door's backlog is full for now
            sock.close()
            if time.monotonic() >= deadline:
                raise EngineClosed(f"the engine did not take the connection within {timeout:.0f} s") from None
            time.sleep(CONNECT_RETRY_S)
        except OSError as e:
            sock.close()
            raise EngineClosed(f"the engine is not reachable ({e.strerror or e})") from None
    try:
        if peer_uid(sock) != os.geteuid():
            raise EngineClosed("the socket at the engine's address belongs to another user")
        sock.sendall(encode({"op": "key", "key": key}))
    except OSError as e:
        sock.close()
        raise EngineClosed(f"the engine is not reachable ({e.strerror or e})") from None
    except EngineClosed:
        sock.close()
        raise
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
