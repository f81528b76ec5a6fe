"""What the engine's door (engine/door/host.py `EngineHost`) answers to each message a connection may send
once its key has given it a role: a room's `hello`, `open` and its session's `result`, `force`, `private` and
`close`; the worker's `admit`, `release`, `load`, `drain` and `fleet`. An admission is the engine's slot
reserved for the job it names, until that job's session opens with it (or it lapses); a session is opened with
its shared memory and eventfd, sent with the answer.

Runs in the engine's process, on the door's thread, but for the opening of a session: tokenising its prompt
and context takes long enough to keep every other connection waiting, so it runs on one of the door's
openers (`_opening`), and its result comes back to the door's thread (`_answer_open`) as the tick's events
do. A session's context is capped (engine/transport/wire.py MAX_CONTEXT_CHARS, MAX_CONTEXT_TOKENS), refused
beyond with SessionRejected's sentence. Knows the engine's session API, the wire's messages and the
shared-memory layout; nothing of the selector loop, keys, buffers or a connection's life, which are the
door's (it answers through `EngineHost._send`, `_refuse` and `_drop`).
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from engine.api import (
    Admit,
    AskLoad,
    Control,
    Drain,
    EngineError,
    Release,
    ReportFleet,
    SessionRejected,
)
from engine.door.host_conn import RoomConn, apply_session_op
from engine.observe.metrics import resident_bytes
from engine.process.malloc import heap_bytes
from engine.transport.link import SessionLink
from engine.transport.wire import (
    CONTROLS,
    MAX_CONTEXT_TOKENS,
    context_error,
    decode_control,
    encode,
    error_message,
    shape_error,
    trace_error,
)

if TYPE_CHECKING:
    from engine.door.gate import Gate
    from engine.tick.engine import Engine
    from engine.transport.link import Layout

log = logging.getLogger("chorus.engine.host")


def figures(engine: Engine) -> dict[str, Any]:
    """What `AskLoad(figures=True)` adds to the load's answer: the snapshot, the live steps (ms, oldest first)
    of the accounting window, this process's resident memory and C heap in use (None where the C library is
    not glibc), and the port of the snapshot endpoint (None without one)."""
    return {
        "snapshot": engine.snapshot().model_dump(mode="json"),
        "live_ms": [round(ms, 3) for ms in list(engine.acct.live_ms)],
        "rss_bytes": resident_bytes(),
        "heap_bytes": heap_bytes(),
        "port": engine.server.port if engine.server is not None else None,
    }


class HostOps:
    """The door's answers, part of `EngineHost`, which holds the engine, its gate, layout and stats, and
    does the sending (`_send`, `_refuse`, `_drop`, `_release_link`, `drain`)."""

    engine: Engine
    gate: Gate
    layout: Layout
    stats: dict[str, int]
    _openers: Executor
    _opened: deque[tuple[RoomConn, str | None, object]]  # (connection, admission, handle or exception)

    def _message(self, conn: RoomConn, line: bytes) -> None:
        why = shape_error(line)
        if why is not None:
            self._refuse(conn, why)
            return
        try:
            msg = json.loads(line)
        except ValueError:
            self._refuse(conn, "not JSON")
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            self._refuse(conn, "not a message")
            return
        op = msg["op"]
        if not self.gate.allowed(conn.role, op):
            self._refuse(conn, f"{op[:40]!r} is not an operation this connection may ask for")
            return
        if op == "hello":
            self._send(conn, encode(self._hello()))
            return
        if op == "open":
            self._open(conn, msg)
            return
        if op in CONTROLS:
            try:
                request = decode_control(op, msg)
            except ValueError as e:
                self._refuse(conn, str(e))
                return
            self._control(conn, request)
            return
        handle = conn.handle
        if handle is None or msg.get("session") != handle.id:
            self._refuse(conn, "a message for a session this connection does not hold")
            return
        if op == "close":
            self._drop(conn)
            return
        try:
            apply_session_op(handle, op, msg)
        except ValueError as e:
            self._refuse(conn, str(e))

    def _control(self, conn: RoomConn, request: Control) -> None:
        """The worker's requests: a slot reserved for a job it is about to accept (`Admit`), one given back by
        a job that ended before it opened its session (`Release`), the engine's load, a drain, the fleet's
        counts."""
        e = self.engine
        match request:
            case AskLoad(with_figures):
                reply = {
                    "op": "load",
                    "load": e.load,
                    "occupancy": e.occupancy,
                    "available": e.pool.available,
                    "num_slots": e.config.num_slots,
                    "up": e.failure is None,
                }
                if with_figures:
                    reply |= figures(e)
            case Admit(job):
                try:
                    e.admit(job)
                except EngineError as err:
                    self._send(conn, encode(error_message(err)))
                    return
                reply = {"op": "admitted", "admission": job}
            case Release(job):
                e.release(job)
                reply = {"op": "released"}
            case Drain(seconds):
                self.drain(seconds)
                reply = {"op": "draining"}
            case ReportFleet(counts):
                e.redispatches = counts
                reply = {"op": "noted"}
        self._send(conn, encode(reply))

    def _hello(self) -> dict[str, Any]:
        e = self.engine
        return {
            "op": "hello",
            "preset": e.config.preset,
            "clock": e.model_cfg.clock.model_dump(),
            "tokens": e.model_cfg.tokens.model_dump(),
            "vocab_size": e.vocab_size,
            "max_result_chars": e.config.max_result_chars,
            "fixed_buffers": e.config.fixed_buffers,
            "echo": e.config.echo,
        }

    def _open(self, conn: RoomConn, msg: dict[str, Any]) -> None:
        if conn.handle is not None or conn.opening:
            self._refuse(conn, "this connection already holds a session")
            return
        prompt, tools, context = msg.get("prompt"), msg.get("tools") or [], msg.get("context", "")
        if not isinstance(prompt, str) or not isinstance(tools, list) or not isinstance(context, str):
            self._refuse(conn, "open: prompt and context must be strings and tools a list")
            return
        job = msg.get("admission")
        admission = job if isinstance(job, str) else None
        trace = msg.get("trace", "")
        if (why := context_error(context) or trace_error(trace)) is not None:
            self._opened.append((conn, admission, SessionRejected(why)))
            self._take_opened()
            return
        link = SessionLink.create(self.layout)
        conn.link, conn.efd = link, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        request = {
            "prompt": prompt,
            "tools": tools,
            "label": str(msg.get("label", ""))[:200],
            "caller": str(msg.get("caller", ""))[:200],
            "admission": admission,
            "context": context,
            "trace": trace,
        }
        conn.opening = True  # its later messages wait for the answer (`_lines`)
        try:
            self._openers.submit(self._opening, conn, request)
        except RuntimeError as e:  # the door is closing
            self._opened.append((conn, admission, e))
            self._take_opened()

    def _opening(self, conn: RoomConn, request: dict[str, Any]) -> None:
        """An opener's work: the session `request` asks for, or why not, handed back to the door's thread."""
        result: object
        try:
            context = request["context"]
            if context and len(self.engine.tokens.encode(context)) > MAX_CONTEXT_TOKENS:
                raise SessionRejected(
                    f"context: more than the {MAX_CONTEXT_TOKENS:,} tokens a session's own part of its "
                    "prompt may have"
                )
            link = conn.link
            result = self.engine.open_session(
                **request, sink=conn.deliver, source=conn.pull, pending=conn.pending, playout=link.playout
            )
        except Exception as e:  # noqa: BLE001 (the refusal or failure is this session's answer, nothing more)
            result = e
        self._opened.append((conn, request["admission"], result))
        self._wake()

    def _take_opened(self) -> None:
        """The openers' results, answered on the door's thread (`_answer_open`)."""
        while self._opened:
            conn, admission, result = self._opened.popleft()
            try:
                self._answer_open(conn, admission, result)
            except Exception as e:  # noqa: BLE001 (one connection's failure closes that connection only)
                self._failed(conn, e)

    def _answer_open(self, conn: RoomConn, admission: str | None, result: object) -> None:
        """The session (`opened`, with its shared memory and eventfd), or the refusal, then what its session
        said meanwhile and the connection's next messages. A room gone meanwhile: its session is closed."""
        conn.opening = False
        if isinstance(result, BaseException):
            if admission is not None:
                self.engine.release(admission)
            self._release_link(conn)
            if not isinstance(result, (EngineError, ValueError, TypeError)):
                self.stats["errors"] += 1
                log.warning("the door could not open a session (%s)", type(result).__name__)
                result = EngineError("the engine could not open this session")
            kind = None if isinstance(result, EngineError) else "SessionRejected"
            self._send(conn, encode(error_message(result, kind)))
        elif conn.closed:
            result.close()
            return
        else:
            conn.handle = result
            self.gate.opened(conn)
            self.stats["sessions"] += 1
            reply = encode({"op": "opened", "session": result.id, "slot": result.slot})
            # the answer and the two descriptors together, before anything else of the session
            self._send(conn, reply, (conn.link.fd, conn.efd))
        later, conn.later = conn.later, []
        for msg in later:
            self._send(conn, msg)
        self._lines(conn)
