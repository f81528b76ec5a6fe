"""Every LiveKit API call is bounded: against a server that takes the connection, reads the request and never
answers, `python -m agent sip ...` exits non-zero within its bound with one line on stderr, and a phone call's
hang-up and transfer fail within theirs (logged without the caller's number, the job's end not held up). A
call that can be sent again (list, delete) is retried once and succeeds when the second try is answered; one
that cannot (a dispatch, a dial, a transfer) is sent once. A malformed LIVEKIT_URL is refused in one line.

The server is `StandIn`, a real socket server on 127.0.0.1. Each try here may take 1 s
(CHORUS_LIVEKIT_API_TIMEOUT_S) and a phone rings 1 s (CHORUS_SIP_RING_TIMEOUT_S); the bounds below are those
numbers worked out by hand, checked with SLACK_S to spare for a busy machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf.message import Message
from livekit.protocol import agent_dispatch as proto_dispatch
from livekit.protocol import room as proto_room
from livekit.protocol import sip as proto_sip

from agent.phone.phone import PhoneLine
from agent.settings import AgentSettings
from envsettings import SettingsError
from test_sip import GUEST_NUMBER, HOTEL_NUMBER, line_for
from twirp_fake import FRONT_DESK, KEY, SECRET

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S, RING_S = "1", "1"  # the settings every test here runs with
SLACK_S = 8.0  # beyond a bound: a shared, busy machine (process start not included; see `sip`)
CLI_LIMIT_S = 45.0  # a command still running this long has no bound at all
# hand-worked bounds: a retried call is two tries of 1 s and a 0.5 s pause; one sent once, one try; a dial
# rings 1 s on top of its try
RETRIED_S, ONCE_S, DIAL_S = 2.5, 1.0, 2.0

Reply = tuple[int, bytes, str]  # HTTP status, body, content type


def ok(message: Message) -> Reply:
    return 200, message.SerializeToString(), "application/protobuf"


def twirp_error(status: int, code: str, msg: str) -> Reply:
    return status, json.dumps({"code": code, "msg": msg}).encode(), "application/json"


class StandIn:
    """The stand-in for a LiveKit server that hangs: a socket server on 127.0.0.1 that accepts every
    connection and reads the request (its Twirp method and body are recorded), then answers only what
    `answer(method, nth)` gives a reply for (nth: 0 for the method's first request); the rest it never
    answers, holding their connections open until `close`."""

    def __init__(self, answer: Callable[[str, int], Reply | None] | None = None) -> None:
        self.answer = answer or (lambda method, nth: None)
        self.requests: list[tuple[str, bytes, float]] = []  # method, body, time.monotonic() when read
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="standin").start()

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.requests]

    def bodies(self, method: str) -> list[bytes]:
        return [body for m, body, _ in self.requests if m == method]

    def first_request_at(self) -> float:
        assert self.requests, "the stand-in got no request"
        return self.requests[0][2]

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            for conn in self._held:
                conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                conn.close()
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            (int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:")), 0
        )
        while len(body) < length and (chunk := conn.recv(65536)):
            body += chunk
        # POST /twirp/livekit.SIP/ListSIPInboundTrunk HTTP/1.1
        method = lines[0].split()[1].rsplit("/", 1)[-1]
        with self._lock:
            nth = self.methods().count(method)
            self.requests.append((method, body, time.monotonic()))
            reply = self.answer(method, nth)
            if reply is None:
                self._held.append(conn)  # read, and never answered
                return
        status, payload, content_type = reply
        conn.sendall(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + payload
        )
        conn.close()


@pytest.fixture
def standin():
    """`standin(answer=None)` starts a StandIn; all are closed after the test."""
    servers: list[StandIn] = []

    def start(answer: Callable[[str, int], Reply | None] | None = None) -> StandIn:
        servers.append(StandIn(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def sip(server_url: str, cwd: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """`python -m agent sip ARGV` as an operator runs it, against `server_url`; and when it exited."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LIVEKIT_URL": server_url}
    env.update(LIVEKIT_API_KEY=KEY, LIVEKIT_API_SECRET=SECRET)
    env.update(CHORUS_LIVEKIT_API_TIMEOUT_S=TIMEOUT_S, CHORUS_SIP_RING_TIMEOUT_S=RING_S)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agent", "sip", *argv],
            cwd=cwd,  # no .env there
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"`sip {argv[0]}` was still running after {CLI_LIMIT_S:.0f} s")
    return done, time.monotonic()


def assert_one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sip {command}: "), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    return lines[0]


# -- the commands against a server that never answers ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "sent", "bound_s"),
    [
        (["list"], ["ListSIPInboundTrunk"] * 2, RETRIED_S),
        (["setup", "--number", HOTEL_NUMBER], ["ListSIPInboundTrunk"] * 2, RETRIED_S),
        (["teardown"], ["ListSIPDispatchRule"] * 2, RETRIED_S),
        (["call", GUEST_NUMBER, "--trunk", "ST_out"], ["CreateDispatch"], ONCE_S),  # sent once
    ],
    ids=["list", "setup", "teardown", "call"],
)
def test_a_sip_command_against_a_server_that_never_answers_exits_in_one_line_within_its_bound(
    standin, tmp_path, argv, sent, bound_s
):
    server = standin()
    done, exited = sip(server.url, tmp_path, *argv)
    line = assert_one_line(done, argv[0])
    print(line, f"({exited - server.first_request_at():.1f} s after the first request)")
    assert done.returncode == 1
    assert f"the LiveKit server at {server.url} did not answer" in line and GUEST_NUMBER not in line
    assert server.methods() == sent  # a list is tried twice, a dispatch once
    assert exited - server.first_request_at() < bound_s + SLACK_S


def test_an_outbound_call_that_gets_no_answer_to_its_dial_is_bounded_by_the_ring_window(standin, tmp_path):
    """The dispatch is answered, the dial never: the dial may take its ring window and one try, then the room
    the agent was sent to is closed (a delete, retried; never answered here either)."""
    dispatched = ok(proto_dispatch.AgentDispatch(id="AD_1"))
    server = standin(lambda method, nth: dispatched if method == "CreateDispatch" else None)
    done, exited = sip(server.url, tmp_path, "call", GUEST_NUMBER, "--trunk", "ST_out")
    line = assert_one_line(done, "call")
    assert done.returncode == 1 and GUEST_NUMBER not in line
    assert "did not answer create_sip_participant within 2 s" in line, line
    assert server.methods() == ["CreateDispatch", "CreateSIPParticipant", "DeleteRoom", "DeleteRoom"]
    (dial,) = server.bodies("CreateSIPParticipant")
    assert proto_sip.CreateSIPParticipantRequest.FromString(dial).ringing_timeout.seconds == 1
    assert exited - server.first_request_at() < ONCE_S + DIAL_S + RETRIED_S + SLACK_S


def test_a_list_whose_first_try_gets_no_answer_is_sent_again_and_succeeds(standin, tmp_path):
    trunk = proto_sip.SIPInboundTrunkInfo(
        sip_trunk_id="ST_standin", name="front-office", numbers=["+15550001"]
    )

    def answer(method: str, nth: int) -> Reply | None:
        if method == "ListSIPInboundTrunk":
            return None if nth == 0 else ok(proto_sip.ListSIPInboundTrunkResponse(items=[trunk]))
        return ok(proto_sip.ListSIPDispatchRuleResponse())

    server = standin(answer)
    done, _ = sip(server.url, tmp_path, "list")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "inbound trunks: 1" in done.stdout and "ST_standin  front-office" in done.stdout
    assert server.methods() == ["ListSIPInboundTrunk", "ListSIPInboundTrunk", "ListSIPDispatchRule"]


# -- a malformed LIVEKIT_URL ------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://[::1", "ftp://x", "http://"])
def test_a_malformed_livekit_url_is_refused_in_one_line_before_any_request(tmp_path, url):
    done, _ = sip(url, tmp_path, "list")
    assert done.returncode == 2  # a setting refused (1: a request that failed)
    assert done.stderr.splitlines() == [
        f"sip list: LIVEKIT_URL={url}: must be a ws://, wss://, http:// or https:// URL with a host, "
        "e.g. wss://hotel.livekit.cloud"
    ], done.stderr


def test_the_livekit_url_setting_takes_a_servers_url_and_nothing_else(monkeypatch):
    for name in ("CHORUS_LIVEKIT_API_TIMEOUT_S", "CHORUS_SIP_RING_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    for url in ("http://[::1", "ftp://x", "http://", "wss://:443", "localhost:7880", "http://host:port"):
        monkeypatch.setenv("LIVEKIT_URL", url)
        with pytest.raises(SettingsError, match="^LIVEKIT_URL="):
            AgentSettings.from_env(dotenv=False)
    for url in ("ws://localhost:7880", "wss://hotel.livekit.cloud", "http://[::1]:7880", "https://lk.test/a"):
        monkeypatch.setenv("LIVEKIT_URL", url)
        assert AgentSettings.from_env(dotenv=False).livekit_url == url


# -- a phone call's hang-up and transfer -------------------------------------------------------------------


@pytest.fixture
def line_env(monkeypatch):
    """The settings a PhoneLine reads (tests/test_sip.py's `line_for`), bounded as the commands above are;
    `line_env(url)` points them at a server."""
    monkeypatch.setenv("LIVEKIT_API_KEY", KEY)
    monkeypatch.setenv("LIVEKIT_API_SECRET", SECRET)
    monkeypatch.setenv("CHORUS_FRONT_DESK_NUMBER", FRONT_DESK)
    monkeypatch.setenv("CHORUS_LIVEKIT_API_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setenv("CHORUS_SIP_RING_TIMEOUT_S", RING_S)
    return lambda url: monkeypatch.setenv("LIVEKIT_URL", url)


async def acted(line: PhoneLine, action: str, limit_s: float) -> float:
    """Ask the line for `action` (no output attached: it acts at once); the seconds until it is done."""
    start = time.monotonic()
    line.request(action)
    try:
        await asyncio.wait_for(asyncio.shield(line.pending), limit_s)
    except TimeoutError:
        pytest.fail(f"the {action} was not done within {limit_s:.0f} s")
    return time.monotonic() - start


def unanswered(
    standin: Callable[[], StandIn],
    line_env: Callable[[str], None],
    caplog: pytest.LogCaptureFixture,
    action: str,
    limit_s: float,
    unanswered_call: str,
) -> tuple[StandIn, PhoneLine]:
    """A guest's phone line on a new stand-in server that never answers, asked for `action` with its logs
    caught from INFO up; the server and the line once the action is done (its outcome and seconds printed).
    The action failed within `limit_s`, its outcome naming the server and the call it did not answer, and
    the failure was logged without the guest's number; the agent may ask again."""
    server = standin()
    line_env(server.url)
    line = line_for(number=GUEST_NUMBER)
    with caplog.at_level(logging.INFO):
        took = asyncio.run(acted(line, action, limit_s))
    print(line.outcome, f"({took:.1f} s)")
    assert line.outcome.startswith(
        f"{action} failed: the LiveKit server at {server.url} did not answer {unanswered_call} within "
    )
    assert line.action is None
    assert f"{action} failed" in caplog.text
    assert GUEST_NUMBER not in caplog.text and "7700900123" not in caplog.text
    return server, line


def test_a_hang_up_the_server_never_answers_fails_within_its_bound_and_logs_no_number(
    standin, line_env, caplog
):
    server, line = unanswered(standin, line_env, caplog, "end", RETRIED_S + SLACK_S, "remove_participant")
    assert line.outcome.endswith(" within 1 s (2 tries)")
    assert not line.acting  # as for a refusal: the model may ask again
    assert server.methods() == ["RemoveParticipant"] * 2  # no answer: the room is not asked for as well


def test_a_transfer_the_server_never_answers_is_sent_once_and_fails_within_its_ring_bound(
    standin, line_env, caplog
):
    server, line = unanswered(
        standin, line_env, caplog, "transfer", DIAL_S + SLACK_S, "transfer_sip_participant"
    )
    assert line.outcome.endswith(" within 2 s")  # the caller stays with the agent, who may try again
    (sent,) = server.bodies("TransferSIPParticipant")  # a second REFER could transfer twice: sent once
    request = proto_sip.TransferSIPParticipantRequest.FromString(sent)
    assert request.transfer_to == f"tel:{FRONT_DESK}" and request.ringing_timeout.seconds == 1


def test_the_jobs_end_waits_for_a_hang_up_under_way_no_longer_than_its_bound(standin, line_env):
    server = standin()
    line_env(server.url)

    async def main() -> tuple[PhoneLine, float]:
        line = line_for()
        line.request("end")  # no output attached: it acts at once
        while not server.requests:
            await asyncio.sleep(0.02)
        start = time.monotonic()
        try:
            await asyncio.wait_for(line.aclose(), RETRIED_S + SLACK_S)  # the job's shutdown callback
        except TimeoutError:
            pytest.fail("the job's end waited on a hang-up that gets no answer")
        return line, time.monotonic() - start

    line, took = asyncio.run(main())
    print(f"aclose took {took:.1f} s")
    assert took < RETRIED_S + SLACK_S
    assert line.pending.done() and line.outcome.startswith("end failed: the LiveKit server at")


def test_a_hang_up_whose_first_tries_get_no_answer_is_sent_again_and_ends_the_call(standin, line_env):
    """Removing the caller and closing the room are deletes: each is sent again once its first try got no
    answer. The room's second try finds it gone (Twirp's not_found), which means the first one closed it."""

    def answer(method: str, nth: int) -> Reply | None:
        if nth == 0:
            return None
        if method == "RemoveParticipant":
            return ok(proto_room.RemoveParticipantResponse())
        return twirp_error(404, "not_found", "requested room does not exist")

    server = standin(answer)
    line_env(server.url)
    line = line_for()
    asyncio.run(acted(line, "end", 2 * RETRIED_S + SLACK_S))
    assert line.outcome == "ended"
    assert server.methods() == ["RemoveParticipant", "RemoveParticipant", "DeleteRoom", "DeleteRoom"]
    gone = [proto_room.DeleteRoomRequest.FromString(b).room for b in server.bodies("DeleteRoom")]
    assert gone == ["call-abc", "call-abc"]
