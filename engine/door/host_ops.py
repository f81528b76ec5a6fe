"""What the engine's door (engine/door/host.py `EngineHost`) answers to each message a connection may send
once its key has given it a role: a room's `hello`, `open` and its session's `result`, `force`, `private` and
`close`; the worker's `admit`, `release`, `load`, `drain` and `fleet`. An admission is the engine's slot
reserved for the job it names, until that job's session opens with it (or it lapses); a session is opened with
its shared memory and eventfd, sent with the answer.

Runs in the engine's process, on the door's thread. Knows the engine's session API, the wire's messages and
the shared-memory layout; nothing of the selector loop, keys, buffers or a connection's life, which are the
door's (it answers through `EngineHost._send`, `_refuse` and `_drop`).
"""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING, Any

from engine.api import Admit, AskLoad, Control, Drain, EngineError, Release, ReportFleet
from engine.client.link import SessionLink
from engine.client.wire import CONTROLS, decode_control, encode, error_message, shape_error
from engine.door.host_conn import RoomConn, apply_session_op

if TYPE_CHECKING:
    from engine.client.link import Layout
    from engine.door.gate import Gate
    from engine.tick.engine import Engine


class HostOps:
    """The door's answers, part of `EngineHost`, which holds the engine, its gate, layout and stats, and
    does the sending (`_send`, `_refuse`, `_drop`, `_release_link`, `drain`)."""

    engine: Engine
    gate: Gate
    layout: Layout
    stats: dict[str, int]

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
            case AskLoad():
                reply = {
                    "op": "load",
                    "load": e.load,
                    "occupancy": e.occupancy,
                    "available": e.pool.available,
                    "num_slots": e.config.num_slots,
                    "up": e.failure is None,
                }
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
        }

    def _open(self, conn: RoomConn, msg: dict[str, Any]) -> None:
        if conn.handle is not None:
            self._refuse(conn, "this connection already holds a session")
            return
        prompt, tools, context = msg.get("prompt"), msg.get("tools") or [], msg.get("context", "")
        if not isinstance(prompt, str) or not isinstance(tools, list) or not isinstance(context, str):
            self._refuse(conn, "open: prompt and context must be strings and tools a list")
            return
        job = msg.get("admission")
        admission = job if isinstance(job, str) else None
        link = SessionLink.create(self.layout)
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        conn.link, conn.efd = link, efd
        try:
            handle = self.engine.open_session(
                prompt,
                tools,
                sink=conn.deliver,
                label=str(msg.get("label", ""))[:200],
                caller=str(msg.get("caller", ""))[:200],
                admission=admission,
                source=conn.pull,
                pending=conn.pending,
                playout=link.playout,
                context=context,
            )
        except (EngineError, ValueError, TypeError) as e:
            if admission is not None:
                self.engine.release(admission)
            self._release_link(conn)
            kind = None if isinstance(e, EngineError) else "SessionRejected"
            self._send(conn, encode(error_message(e, kind)))
            return
        conn.handle = handle
        self.stats["sessions"] += 1
        reply = encode({"op": "opened", "session": handle.id, "slot": handle.slot})
        try:  # the answer and the two descriptors together, before anything else on this connection
            conn.sock.setblocking(True)
            conn.sock.settimeout(2.0)
            socket.send_fds(conn.sock, [reply], [link.fd, efd])
        except OSError:
            self._drop(conn)
        finally:
            link.forget_fd()  # the mapping stays; the room holds its own descriptor now
            if not conn.closed:
                conn.sock.setblocking(False)
