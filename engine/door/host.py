"""The engine's door for rooms that run in other processes: one Unix socket, one connection per session (each
an engine/door/host_conn.py `RoomConn`), and the worker's admissions, load and drain. Knows the engine's
session API, sockets and the shared-memory layout; nothing of LiveKit or rooms.

A room's process (engine/client/remote.py) connects, asks for a session and gets back, with the answer, the
session's shared memory (engine/transport/link.py) and an eventfd that the tick signals when it has written
frames. From then on caller audio and agent audio cross through the shared memory, with no Python object,
pickle or socket per frame. What is left crosses the socket as one JSON object a line:

- the worker -> engine: `admit` (a slot reserved for a job it is about to accept), `release`, `load`,
  `drain` (passed on to every room with a session);
- room -> engine: `hello`, `open` (naming its job's admission), then `result`
  (a tool's output), `force` (teacher forcing), `private` (words to keep out of the snapshot) and `close`,
  each naming its session;
- engine -> room: `hello` (the engine's clock, tokens and preset), `opened` (with the two descriptors) or
  `error`, then `event` (every output but audio frames, numbered, with the frames written before it) and
  `drain`.

What the door answers to each message is engine/door/host_ops.py's; the socket, its connections, their
keys and what is sent on them are this module's. The door's thread never waits on a connection: what it sends
is queued per connection and sent as the socket takes it (the answer to `open` with its two descriptors on
its first byte), and a connection that lets more than MAX_QUEUED wait is closed; a session is opened (its
prompt tokenised) on an opener thread, and its answer comes back to the door's thread.

Who may connect, with which key, and ask for what is engine/door/gate.py's: a process of another user is
closed as it connects, one without a key within 2 s is closed, the rooms' key opens sessions and the worker's
asks for admissions, load and drain. A connection that closes, for whatever reason (the room's process killed
included), closes its session: the slot is free at the next tick. A message that is not a JSON object, is
nested deeper than engine/transport/wire.py MAX_DEPTH or longer than MAX_LINE, names an operation its role may
not ask for or another session, is refused and counted (`stats`); the connection stays, and nothing of it
reaches another session. Whatever goes wrong handling one message or one connection refuses that message or
closes that connection, and is counted (`errors`): it never stops the door. The socket lives in the abstract
namespace (no file to clean up).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.door.gate import MAX_KEY_LINE, Gate
from engine.door.host_conn import RoomConn
from engine.door.host_ops import HostOps
from engine.transport.link import Layout
from engine.transport.wire import MAX_LINE, DoorKeys, encode

if TYPE_CHECKING:
    from engine.tick.engine import Engine

log = logging.getLogger("chorus.engine.host")

MAX_QUEUED = 1 << 20  # bytes waiting for a peer that does not read: beyond this its connection is closed
OPENERS = 2  # threads that open sessions (tokenising a prompt) off the door's thread
RETIRE_S = 5.0  # a closed session's eventfd stays open this long (see `_release_link`)
ACCEPT_BATCH = 64  # connections taken from the queue before the ones already open are served again


def _worth_a_line(n: int) -> bool:
    """A count logged at 1, 10, 100, ...: a flood is seen in the log without filling it."""
    return n > 0 and 10 ** (len(str(n)) - 1) == n


class EngineHost(HostOps):
    """Serves `engine` to rooms in other processes on `address` (an abstract Unix socket name; a fresh one by
    default) to the holders of `keys` (fresh ones by default). `start` runs its thread; `close` ends every
    connection (their sessions close); `alive` is false once its thread has stopped."""

    def __init__(self, engine: Engine, address: str | None = None, keys: DoorKeys | None = None) -> None:
        self.engine = engine
        self.address = address or f"chorus-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.keys = keys or DoorKeys.fresh()
        self.gate = Gate(self.keys, engine.config.num_slots)
        clock = engine.model_cfg.clock
        self.layout = Layout(clock.input_samples, clock.output_samples)
        self._sel = selectors.DefaultSelector()
        self._listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listen.bind("\0" + self.address)
        self._listen.listen(256)
        self._listen.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._outbox: deque[tuple[RoomConn, bytes]] = deque()  # from the tick thread and `drain`
        self._opened: deque[tuple[RoomConn, str | None, object]] = deque()  # the openers' results (host_ops)
        self._openers = ThreadPoolExecutor(OPENERS, thread_name_prefix="chorus-door-open")
        self._conns: set[RoomConn] = set()
        self._retired: deque[tuple[float, int]] = deque()  # (when, eventfd) of closed sessions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {
            "connections": 0,
            "sessions": 0,
            "bad_messages": 0,  # refused: not JSON, unknown operation, another session's, too long
            "dropped_connections": 0,  # closed for not reading what the engine sent (MAX_QUEUED)
            "lost_frames": 0,  # caller frames a room wrote faster than the tick took them
            "bad_counters": 0,  # a room's ring counter that went backwards
            "refused_peers": 0,  # connections of another user, closed unread
            "refused_keys": 0,  # closed for a missing or wrong key, none in time, or a role's cap reached
            "errors": 0,  # a message or a connection whose handling failed: refused or closed
        }

    # -- life -------------------------------------------------------------------------------------------

    def start(self) -> EngineHost:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chorus-host", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The door's thread runs (a door that stopped by itself is a failed engine: engine/door/serve.py)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        self._openers.shutdown(wait=True, cancel_futures=True)
        self._take_opened()
        for conn in list(self._conns):
            self._drop(conn)
        for _, fd in self._retired:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._retired.clear()
        with contextlib.suppress(OSError):
            self._listen.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def drain(self, seconds: float) -> None:
        """Tell every room with a session that the worker is draining (its calls have `seconds` left)."""
        msg = encode({"op": "drain", "seconds": float(seconds)})
        for conn in list(self._conns):
            if conn.handle is not None:
                self._send(conn, msg)

    # -- the host thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=0.5):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._serve(key.data, mask)
                self._take_opened()
                self._take_outbox()
                self._close_retired()
                for conn in self.gate.expired(time.monotonic()):
                    self.stats["refused_keys"] += 1
                    self._drop(conn)
        except Exception:
            log.exception("the engine host stopped")
            raise

    def _serve(self, conn: RoomConn, mask: int) -> None:
        """One connection's turn: whatever fails in it closes that connection, counted, and nothing more."""
        try:
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self._flush(conn)
        except Exception as e:  # noqa: BLE001 (one connection's failure closes that connection only, never the door)
            self._failed(conn, e)

    def _failed(self, conn: RoomConn, e: BaseException) -> None:
        self.stats["errors"] += 1
        n = self.stats["errors"]
        if _worth_a_line(n):
            log.warning("a connection to the door failed (%s); %d so far", type(e).__name__, n)
        self._drop(conn)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the queue waits for the next turn
                self.stats["errors"] += 1
                log.warning("the door could not accept a connection (%s)", e.strerror or e)
                return
            peer = self.gate.accept(sock)
            if peer is None:
                self.stats["refused_peers"] += 1
                n = self.stats["refused_peers"]
                if _worth_a_line(n):
                    log.warning("closed a connection from another user's process; %d so far", n)
                sock.close()
                continue
            sock.setblocking(False)
            conn = RoomConn(sock, self.stats, self._post, peer)
            evicted = self.gate.pending(conn)  # the oldest without a key goes before the new one is held
            if evicted is not None:
                self.stats["refused_keys"] += 1
                self._drop(evicted)
            self._conns.add(conn)
            self.stats["connections"] += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._serve(conn, selectors.EVENT_READ)  # its key was sent with the connection: read it now

    def _read(self, conn: RoomConn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.rx += data
        self._lines(conn)

    def _lines(self, conn: RoomConn) -> None:
        """The whole messages `conn` has sent, in turn (none while its `open` is being handled)."""
        while not conn.closed and not conn.opening:
            end = conn.rx.find(b"\n")
            if end < 0:
                if conn.role is None and len(conn.rx) > MAX_KEY_LINE:
                    self._unkeyed(conn, "a key line longer than the limit")
                elif len(conn.rx) > MAX_LINE:
                    self._refuse(conn, "a message longer than the limit")
                    self._drop(conn)
                return
            line = bytes(conn.rx[:end])
            del conn.rx[: end + 1]
            if conn.role is None:
                self._key(conn, line)
                continue
            try:
                self._message(conn, line)
            except Exception as e:  # noqa: BLE001 (a message's handling failed: that message is refused, nothing else)
                self.stats["errors"] += 1
                log.warning("the door could not handle a message (%s)", type(e).__name__)
                self._refuse(conn, "the engine could not handle this message")

    def _key(self, conn: RoomConn, line: bytes) -> None:
        """A connection's first line: its key, and so its role (or it is closed)."""
        msg = None
        if len(line) <= MAX_KEY_LINE:
            with contextlib.suppress(ValueError, RecursionError):
                msg = json.loads(line)
        why = self.gate.key(conn, msg)
        if why is not None:
            self._unkeyed(conn, why)

    def _unkeyed(self, conn: RoomConn, why: str) -> None:
        self.stats["refused_keys"] += 1
        n = self.stats["refused_keys"]
        if _worth_a_line(n):
            log.warning("closed a connection to the door (%s); %d so far", why, n)
        self._send(conn, encode({"op": "refused", "why": why}))
        self._drop(conn)

    def _refuse(self, conn: RoomConn, why: str) -> None:
        self.stats["bad_messages"] += 1
        if _worth_a_line(self.stats["bad_messages"]):
            log.warning("refused a room's message (%s); %d refused so far", why, self.stats["bad_messages"])
        self._send(conn, encode({"op": "refused", "why": why[:200]}))

    def _post(self, conn: RoomConn, msg: bytes) -> None:
        """An event from the tick thread, for this thread to send (the tick never touches a socket)."""
        self._outbox.append((conn, msg))
        self._wake()

    # -- sending ----------------------------------------------------------------------------------------

    def _take_outbox(self) -> None:
        while self._outbox:
            conn, msg = self._outbox.popleft()
            self._send(conn, msg)

    def _send(self, conn: RoomConn, msg: bytes, fds: tuple[int, int] | None = None) -> None:
        """Queue `msg` for `conn` (with `fds` on its first byte) and send what the socket takes now: the door
        never waits on a peer. One that lets more than MAX_QUEUED wait is closed (its session with it)."""
        if conn.closed:
            return
        if threading.current_thread() is not self._thread:
            self._outbox.append((conn, msg))
            self._wake()
            return
        if conn.opening:  # the answer to its `open` goes first
            conn.later.append(msg)
        else:
            if fds is not None:
                conn.fds, conn.fds_at = fds, len(conn.tx)
            conn.tx += msg
        if len(conn.tx) + sum(map(len, conn.later)) > MAX_QUEUED:
            self.stats["dropped_connections"] += 1
            n = self.stats["dropped_connections"]
            if _worth_a_line(n):
                log.warning("a %s connection stopped reading the door's answers; %d closed", conn.role, n)
            self._drop(conn)
            return
        self._flush(conn)

    def _flush(self, conn: RoomConn) -> None:
        try:
            while conn.tx:
                if conn.fds is not None and conn.fds_at == 0:
                    n = socket.send_fds(conn.sock, [conn.tx], list(conn.fds))
                    conn.fds = None
                    if conn.link is not None:
                        conn.link.forget_fd()  # the mapping stays; the room holds its own descriptor now
                elif conn.fds is not None:
                    n = conn.sock.send(conn.tx[: conn.fds_at])
                    conn.fds_at -= n
                else:
                    n = conn.sock.send(conn.tx)
                del conn.tx[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.tx else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: RoomConn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.gate.forget(conn)
        if conn.handle is not None:
            conn.handle.close()
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._conns.discard(conn)
        self._release_link(conn)

    def _release_link(self, conn: RoomConn) -> None:
        """The tick may be writing to a session closed a moment ago: its shared memory is unmapped only with
        the last reference to it (the session's sink, gone when the pool frees the slot), and its eventfd is
        closed RETIRE_S later, so that no write can reach a descriptor number that was reused."""
        if conn.link is not None:
            conn.link.forget_fd()
        if conn.efd >= 0:
            self._retired.append((time.monotonic(), conn.efd))
            conn.efd = -1

    def _close_retired(self) -> None:
        now = time.monotonic()
        while self._retired and now - self._retired[0][0] > RETIRE_S:
            with contextlib.suppress(OSError):
                os.close(self._retired.popleft()[1])
