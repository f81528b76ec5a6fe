"""Who may use the engine's door (engine/door/host.py), and how much of it: the kernel's credentials of each
connecting process, a key per role, the operations each role may ask for, and caps on connections.

An abstract Unix socket has no file whose owner and mode could keep anyone out: any process in the network
namespace can connect. So the door admits a process only

- of the engine's own user id (SO_PEERCRED, read as the connection is accepted: another user's is closed
  before a byte of it is read), and
- whose first line is `{"op": "key", "key": ...}` with one of the two keys the worker made for this engine
  (engine/client/wire.py DoorKeys), within AUTH_S of connecting. The key says the connection's role:

  - `room` (the key a worker hands its rooms' processes): `hello`, `open`, and then only its own session's
    operations (the session it opened on this connection);
  - `control` (the worker's own, never in any process's environment): `hello`, `admit`, `release`, `load`
    and `drain`.

Connections without a key yet are at most MAX_PENDING (the oldest is closed for a newer one), and each role
holds at most its cap; the worker keeps one connection open for all its questions, so no flood of
connections stands between it and its engine. Knows sockets and the roles; nothing of sessions or the tick.
"""

from __future__ import annotations

import hmac
import os
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.client.wire import DoorKeys, peer_uid

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


def room_cap(num_slots: int) -> int:
    """Room connections at once: a session's each, and a few for the rooms' `hello`s."""
    return 2 * num_slots + 16


class Gate:
    """The door's guard: `accept(sock)` says whether a new connection may stay (the peer's user id), `key`
    gives a connection its role or says why not, `allowed` whether its role may ask for an operation;
    `pending` and `expired` keep the connections without a key bounded in number and time."""

    def __init__(self, keys: DoorKeys, num_slots: int, uid: int | None = None) -> None:
        self.keys = keys
        self.uid = os.geteuid() if uid is None else uid
        self.caps = {ROOM: room_cap(num_slots), CONTROL: CONTROL_CAP}
        self.held = {ROOM: 0, CONTROL: 0}
        self._pending: OrderedDict[RoomConn, float] = OrderedDict()  # by when they connected

    def accept(self, sock: socket.socket) -> bool:
        """Whether a process of the engine's own user is at the other end."""
        try:
            return peer_uid(sock) == self.uid
        except OSError:
            return False

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
        if self.held[role] >= self.caps[role]:
            return f"too many {role} connections"
        self.held[role] += 1
        conn.role = role
        return None

    def forget(self, conn: RoomConn) -> None:
        """A connection closed: its place is free."""
        self._pending.pop(conn, None)
        if conn.role is not None:
            self.held[conn.role] -= 1
            conn.role = None

    @staticmethod
    def allowed(role: str | None, op: str) -> bool:
        return role is not None and op in OPS[role]
