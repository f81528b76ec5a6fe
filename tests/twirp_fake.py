"""A protocol fake of the LiveKit server's API, for tests only: no LiveKit server can run here.

It speaks Twirp as LiveKit does (POST /twirp/livekit.<Service>/<Method>, protobuf bodies, JSON errors),
checks each request's bearer token against its own key and secret, records every request it accepted
(service, method, decoded message, grants), and keeps just enough state for the calls Chorus makes: SIP
inbound trunks and dispatch rules, rooms, agent dispatches, SIP participants and transfers.
`fail(method, ...)` makes the next request to a method answer with an error (a refused call, a failed
transfer). It runs in a daemon thread on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from google.protobuf.message import Message
from livekit import api
from livekit.protocol import agent_dispatch as proto_dispatch
from livekit.protocol import room as proto_room
from livekit.protocol import sip as proto_sip

KEY, SECRET = "test-key", "test-secret-that-is-long-enough-for-hs256"
FRONT_DESK = "+14155550199"  # the front desk number the `livekit` fixture (tests/conftest.py) configures


@dataclass
class Received:
    service: str
    method: str
    request: Message
    grants: Any


@dataclass
class LiveKitFake:
    key: str = KEY
    secret: str = SECRET
    received: list[Received] = field(default_factory=list)
    trunks: dict[str, proto_sip.SIPInboundTrunkInfo] = field(default_factory=dict)
    rules: dict[str, proto_sip.SIPDispatchRuleInfo] = field(default_factory=dict)
    rooms: set[str] = field(default_factory=set)
    participants: dict[str, set[str]] = field(default_factory=dict)  # room -> identities
    failures: dict[str, tuple[int, dict]] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- what tests use -----------------------------------------------------------------------------------

    def calls(self, method: str | None = None) -> list[Received]:
        return [r for r in self.received if method is None or r.method == method]

    def methods(self) -> list[str]:
        return [r.method for r in self.received]

    def fail(self, method: str, status: int, code: str, msg: str, meta: dict[str, str] | None = None) -> None:
        self.failures[method] = (status, {"code": code, "msg": msg, "meta": meta or {}})

    # -- the API --------------------------------------------------------------------------------------------

    def add_trunk(self, req: proto_sip.CreateSIPInboundTrunkRequest) -> Message:
        """A trunk the server already holds, made by someone else (not a request Chorus sent)."""
        with self._lock:
            return self._create_trunk(req)

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}"

    def handle(self, service: str, method: str, body: bytes, grants: Any) -> Message:
        request_type, run = self.ROUTES[(service, method)]
        request = request_type.FromString(body)
        with self._lock:
            self.received.append(Received(service, method, request, grants))
            if method in self.failures:
                status, error = self.failures.pop(method)
                raise _Refusal(status, error)
            return run(self, request)

    def _stored(self, store: dict, id_field: str, key: str, src: Message) -> Message:
        """A copy of `src` under `key` (its id field set to it), kept in `store`."""
        item = type(src)()
        item.CopyFrom(src)
        setattr(item, id_field, key)
        store[key] = item
        return item

    def _replace(self, store: dict, id_field: str, key: str, src: Message, what: str) -> Message:
        if key not in store:
            raise _Refusal(404, {"code": "not_found", "msg": f"no such {what}"})
        return self._stored(store, id_field, key, src)

    @staticmethod
    def _drop(store: dict, key: str, what: str) -> None:
        if store.pop(key, None) is None:
            raise _Refusal(404, {"code": "not_found", "msg": f"no such {what}"})

    def _create_trunk(self, req: proto_sip.CreateSIPInboundTrunkRequest) -> Message:
        return self._stored(self.trunks, "sip_trunk_id", self._id("ST"), req.trunk)

    def _update_trunk(self, req: proto_sip.UpdateSIPInboundTrunkRequest) -> Message:
        return self._replace(self.trunks, "sip_trunk_id", req.sip_trunk_id, req.replace, "trunk")

    def _list_trunks(self, req: proto_sip.ListSIPInboundTrunkRequest) -> Message:
        return proto_sip.ListSIPInboundTrunkResponse(items=list(self.trunks.values()))

    def _delete_trunk(self, req: proto_sip.DeleteSIPTrunkRequest) -> Message:
        self._drop(self.trunks, req.sip_trunk_id, "trunk")
        return proto_sip.SIPTrunkInfo(sip_trunk_id=req.sip_trunk_id)

    def _create_rule(self, req: proto_sip.CreateSIPDispatchRuleRequest) -> Message:
        return self._stored(self.rules, "sip_dispatch_rule_id", self._id("SDR"), req.dispatch_rule)

    def _update_rule(self, req: proto_sip.UpdateSIPDispatchRuleRequest) -> Message:
        return self._replace(
            self.rules, "sip_dispatch_rule_id", req.sip_dispatch_rule_id, req.replace, "rule"
        )

    def _list_rules(self, req: proto_sip.ListSIPDispatchRuleRequest) -> Message:
        return proto_sip.ListSIPDispatchRuleResponse(items=list(self.rules.values()))

    def _delete_rule(self, req: proto_sip.DeleteSIPDispatchRuleRequest) -> Message:
        self._drop(self.rules, req.sip_dispatch_rule_id, "rule")
        return proto_sip.SIPDispatchRuleInfo(sip_dispatch_rule_id=req.sip_dispatch_rule_id)

    def _dispatch(self, req: proto_dispatch.CreateAgentDispatchRequest) -> Message:
        self.rooms.add(req.room)  # a dispatch creates its room
        return proto_dispatch.AgentDispatch(
            id=self._id("AD"), agent_name=req.agent_name, room=req.room, metadata=req.metadata
        )

    def _dial(self, req: proto_sip.CreateSIPParticipantRequest) -> Message:
        if req.room_name not in self.rooms:
            raise _Refusal(404, {"code": "not_found", "msg": "no such room"})
        self.participants.setdefault(req.room_name, set()).add(req.participant_identity)
        return proto_sip.SIPParticipantInfo(
            participant_id=self._id("PA"),
            participant_identity=req.participant_identity,
            room_name=req.room_name,
            sip_call_id=self._id("SCL"),
        )

    def _transfer(self, req: proto_sip.TransferSIPParticipantRequest) -> Message:
        self.participants.get(req.room_name, set()).discard(req.participant_identity)
        return proto_sip.TransferSIPParticipantResponse(transfer_id=self._id("STR"))

    def _remove(self, req: proto_room.RoomParticipantIdentity) -> Message:
        present = self.participants.get(req.room, set())
        if req.identity not in present:
            raise _Refusal(404, {"code": "not_found", "msg": "participant not found"})
        present.discard(req.identity)
        return proto_room.RemoveParticipantResponse()

    def _delete_room(self, req: proto_room.DeleteRoomRequest) -> Message:
        self.rooms.discard(req.room)
        self.participants.pop(req.room, None)
        return proto_room.DeleteRoomResponse()

    ROUTES: ClassVar[dict] = {
        ("SIP", "CreateSIPInboundTrunk"): (proto_sip.CreateSIPInboundTrunkRequest, _create_trunk),
        ("SIP", "UpdateSIPInboundTrunk"): (proto_sip.UpdateSIPInboundTrunkRequest, _update_trunk),
        ("SIP", "ListSIPInboundTrunk"): (proto_sip.ListSIPInboundTrunkRequest, _list_trunks),
        ("SIP", "DeleteSIPTrunk"): (proto_sip.DeleteSIPTrunkRequest, _delete_trunk),
        ("SIP", "CreateSIPDispatchRule"): (proto_sip.CreateSIPDispatchRuleRequest, _create_rule),
        ("SIP", "UpdateSIPDispatchRule"): (proto_sip.UpdateSIPDispatchRuleRequest, _update_rule),
        ("SIP", "ListSIPDispatchRule"): (proto_sip.ListSIPDispatchRuleRequest, _list_rules),
        ("SIP", "DeleteSIPDispatchRule"): (proto_sip.DeleteSIPDispatchRuleRequest, _delete_rule),
        ("SIP", "CreateSIPParticipant"): (proto_sip.CreateSIPParticipantRequest, _dial),
        ("SIP", "TransferSIPParticipant"): (proto_sip.TransferSIPParticipantRequest, _transfer),
        ("AgentDispatchService", "CreateDispatch"): (proto_dispatch.CreateAgentDispatchRequest, _dispatch),
        ("RoomService", "RemoveParticipant"): (proto_room.RoomParticipantIdentity, _remove),
        ("RoomService", "DeleteRoom"): (proto_room.DeleteRoomRequest, _delete_room),
    }

    # -- the server -----------------------------------------------------------------------------------------

    def serve(self) -> tuple[str, ThreadingHTTPServer]:
        """Start serving; returns (url, server). Stop with server.shutdown()."""
        fake = self
        verifier = api.TokenVerifier(self.key, self.secret)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status: int, error: dict) -> None:
                self._answer(status, json.dumps(error).encode(), "application/json")

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "twirp" or not parts[1].startswith("livekit."):
                    return self._error(404, {"code": "bad_route", "msg": f"no route {self.path}"})
                service, method = parts[1].removeprefix("livekit."), parts[2]
                if (service, method) not in fake.ROUTES:
                    return self._error(404, {"code": "bad_route", "msg": f"no method {service}/{method}"})
                auth = self.headers.get("Authorization", "")
                try:
                    claims = verifier.verify(auth.removeprefix("Bearer "))
                except Exception:  # noqa: BLE001 (any token the verifier refuses is unauthenticated, as the server answers)
                    return self._error(401, {"code": "unauthenticated", "msg": "invalid token"})
                grants = {"video": claims.video, "sip": claims.sip}
                try:
                    reply = fake.handle(service, method, body, grants)
                except _Refusal as r:
                    return self._error(r.status, r.error)
                self._answer(200, reply.SerializeToString(), "application/protobuf")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="livekit-fake").start()
        return f"http://127.0.0.1:{server.server_address[1]}", server


class _Refusal(Exception):
    def __init__(self, status: int, error: dict) -> None:
        super().__init__(error.get("msg", ""))
        self.status = status
        self.error = error
