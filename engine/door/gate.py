"""Who may use the engine's door (engine/door/host.py), and how much of it: the kernel's credentials of each
connecting process, a key per role, the operations each role may ask for, and caps on connections.

An abstract Unix socket has no file whose owner and mode could keep anyone out: any process in the network
namespace can connect. So the door admits a process only

- of the engine's own user id (SO_PEERCRED, read as the connection is accepted: another user's is closed
  before a byte of it is read), and
- whose first line is `{"op": "key", "key": ...}` with one of the two keys the worker made for this engine
  (engine/transport/wire.py DoorKeys), within AUTH_S of connecting. The key says the connection's role:

  - `room` (the key a worker hands its rooms' processes): `hello`, `open`, and then only its own session's
    operations (the session it opened on this connection);
  - `control` (the worker's own, never in any process's environment): `hello`, `admit`, `release`, `load`
    and `drain`.

Connections without a key yet are at most MAX_PENDING (the oldest is closed for a newer one). The worker's
role holds at most CONTROL_CAP (it keeps one connection open for all its questions, so no flood of connections
stands between it and its engine). A room connection that holds a session is bounded by the engine's slots;
those without one (a `hello`, an `open` not answered yet) are bounded per room's process (ROOM_PEER_CAP, by
the kernel's process id of the peer) and in all (`room_cap`), so one room holding idle connections never stops
another room's `open`. Knows sockets and the roles; nothing of sessions or the tick.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from engine.transport.wire import DoorKeys

if TYPE_CHECKING:
    from engine.door.host_conn import RoomConn

ROOM, CONTROL = "room", "control"
OPS = {
    ROOM: frozenset({"hello", "open", "result", "force", "pad_between", "private", "close"}),
    CONTROL: frozenset({"hello", "admit", "release", "load", "drain", "fleet"}),
}
AUTH_S = 2.0  # a connection that has not shown its key by then is closed
MAX_PENDING = 32  # connections without a key yet; the oldest goes for a newer one
MAX_KEY_LINE = 256  # the key's line: longer before its end, and the connection is closed
CONTROL_CAP = 8  # the worker's connections (it keeps one; a few more while one is replaced)
# room connections without a session, of one room's process: a room's `hello` and `open` take one each for a
# moment; a process that runs many rooms through the door (the simulation) opens a few sessions at once
ROOM_PEER_CAP = 16


def room_cap(num_slots: int) -> int:
    """Room connections without a session at once, of every room's process together."""
    return 2 * num_slots + 16


def peer_creds(sock: socket.socket) -> tuple[int, int]:
    """The process id and user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


class Gate:
    """The door's guard: `accept(sock)` says whether a new connection may stay (the peer's user id) and names
    its process, `key` gives a connection its role or says why not, `opened` moves a room connection from the
    caps on those without a session, `allowed` whether its role may ask for an operation; `pending` and
    `expired` keep the connections without a key bounded in number and time."""

    def __init__(self, keys: DoorKeys, num_slots: int, uid: int | None = None) -> None:
        self.keys = keys
        self.uid = os.geteuid() if uid is None else uid
        self.caps = {ROOM: room_cap(num_slots), CONTROL: CONTROL_CAP}
        self.held = {ROOM: 0, CONTROL: 0}  # room: those without a session
        self.by_peer: Counter[int] = Counter()  # room connections without a session, by the peer's process
        self._pending: OrderedDict[RoomConn, float] = OrderedDict()  # by when they connected

    def accept(self, sock: socket.socket) -> int | None:
        """The process id at the other end when it is a process of the engine's own user, else None."""
        try:
            pid, uid = peer_creds(sock)
        except OSError:
            return None
        return pid if uid == self.uid else None

    def pending(self, conn: RoomConn) -> RoomConn | None:
        """Count a connection without a key yet; the oldest one to close if there are now too many."""
        self._pending[conn] = time.monotonic()
        if len(self._pending) > MAX_PENDING:
            oldest, _ = self._pending.popitem(last=False)
            return oldest
        return None

    def expired(self, now: float) -> list[RoomConn]:
        """Connections that showed no key within AUTH_S (no longer counted as pending)."""
        out = []
        while self._pending:
            conn, at = next(iter(self._pending.items()))
            if now - at <= AUTH_S:
                break
            self._pending.popitem(last=False)
            out.append(conn)
        return out

    def key(self, conn: RoomConn, msg: object) -> str | None:
        """Give `conn` the role its key names (None returned) or say why not (the connection is closed)."""
        self._pending.pop(conn, None)
        if not isinstance(msg, dict) or msg.get("op") != "key" or not isinstance(msg.get("key"), str):
            return "a key is required first"
        given = msg["key"].encode()
        role = next(
            (
                r
                for r, k in ((ROOM, self.keys.room), (CONTROL, self.keys.control))
                if hmac.compare_digest(given, k.encode())
            ),
            None,
        )
        if role is None:
            return "a wrong key"
        if role == ROOM and self.by_peer[conn.peer] >= ROOM_PEER_CAP:
            return "too many room connections without a session from this process"
        if self.held[role] >= self.caps[role]:
            return f"too many {role} connections"
        self.held[role] += 1
        if role == ROOM:
            self.by_peer[conn.peer] += 1
        conn.role = role
        return None

    def opened(self, conn: RoomConn) -> None:
        """A room connection now holds a session: the engine's slots bound it, its place here is free."""
        if conn.role == ROOM and not conn.in_session:
            conn.in_session = True
            self._free_room_place(conn.peer)

    def forget(self, conn: RoomConn) -> None:
        """A connection closed: its place is free."""
        self._pending.pop(conn, None)
        if conn.role is not None:
            if conn.role == CONTROL:
                self.held[CONTROL] -= 1
            elif not conn.in_session:
                self._free_room_place(conn.peer)
            conn.role = None

    def _free_room_place(self, peer: int) -> None:
        self.held[ROOM] -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]

    @staticmethod
    def allowed(role: str | None, op: str) -> bool:
        return role is not None and op in OPS[role]
