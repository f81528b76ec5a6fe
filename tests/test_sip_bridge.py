"""An inbound phone call through the real LiveKit server's SIP machinery (scripts/livekit.sh, with Redis).

LiveKit's SIP bridge does not build here, so scripts/sip-bridge stands in for its control plane: over psrpc on
the server's Redis it asks the server to authenticate the trunk and evaluate the dispatch rules that
`python -m agent sip setup` made, and signs the SIP participant's token as the bridge does. No SIP, RTP or
G.711 is on the wire: the caller is a WebRTC participant that joins with that token, so the server sees a
participant of kind SIP, the dispatch rule's room configuration dispatches the worker's agent, and the agent
answers with the phone concierge.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from agent.call import room_label
from agent.fleet.fleet import BEAT_S, SWEEP_S
from livekit_support import POLL_S, require_livekit
from testkit.callers import RATE, caller_pcm
from testkit.server import Server, agent_sip
from testkit.sip import PhoneCaller, find_bridge, inbound
from testkit.worker import Worker, sessions_by_label
from wait_support import await_until, wait_until

READ_SLACK_S = 0.02  # one audio frame

pytestmark = pytest.mark.livekit

TRUNK_NUMBER = "+15550100"  # fictional (+1 555 01xx)
CALLER_NUMBER = "+15550123"


def _miss(message: str) -> None:
    (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(message)


@pytest.fixture(scope="module")
def server() -> Server:
    s = require_livekit()
    if not os.environ.get("CHORUS_TEST_LIVEKIT_REDIS"):
        _miss("the LiveKit server runs without Redis (install redis-server): its SIP API needs it")
    return s


@pytest.fixture(scope="module")
def bridge() -> Path:
    """The sip-bridge binary (`find_bridge`); skipped when none can be had (failed under CI=true)."""
    found = find_bridge()
    if isinstance(found, str):
        _miss(found)
    return found


async def _participants(server: Server, room: str) -> list:
    from livekit import api

    lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
    try:
        return list((await lk.room.list_participants(api.ListParticipantsRequest(room=room))).participants)
    finally:
        await lk.aclose()


def test_an_inbound_call_is_put_in_a_room_by_the_servers_dispatch_rule_and_answered_by_the_phone_concierge(
    server, bridge, store_dir
):
    from livekit import rtc

    worker = Worker(server, store_dir, slots=1).launch()  # it loads while the line is set up
    name = f"sipbr-{uuid.uuid4().hex[:6]}"
    try:
        setup = agent_sip(
            server, "setup", "--number", TRUNK_NUMBER, "--name", name, agent_name=worker.agent_name
        )
        assert setup.returncode == 0, setup.stderr
        nowhere = inbound(server, bridge, "--from", CALLER_NUMBER, "--to", "+15550199")
        assert nowhere.returncode == 1 and "no rule matched" in nowhere.stdout, (
            nowhere.stdout,
            nowhere.stderr,
        )

        out = inbound(server, bridge, "--from", CALLER_NUMBER, "--to", TRUNK_NUMBER)
        assert out.returncode == 0, (out.stdout, out.stderr)
        call = json.loads(out.stdout)
        # a room of its own, named after the number called, never the caller's
        assert call["room"].startswith(f"call-_{TRUNK_NUMBER}_"), call["room"]
        assert CALLER_NUMBER not in call["room"] and CALLER_NUMBER[1:] not in call["room"]
        assert call["identity"] == f"sip_{CALLER_NUMBER}"
        attrs = call["attributes"]
        assert attrs["sip.phoneNumber"] == CALLER_NUMBER and attrs["sip.trunkPhoneNumber"] == TRUNK_NUMBER
        assert attrs["sip.trunkID"] == call["trunk_id"] and attrs["sip.ruleID"] == call["rule_id"]
        assert attrs["sip.callID"] == call["call_id"]
        assert call["dispatch"] == [worker.agent_name]
        worker.start(timeout=60)

        async def phone_call() -> tuple[PhoneCaller, list]:
            caller = PhoneCaller(server, call)
            await caller.join()
            try:
                assert caller.room.local_participant.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
                await asyncio.wait_for(caller.agent_joined.wait(), 30)
                await asyncio.wait_for(caller.first_audio.wait(), 20)  # the agent's track, subscribed
                await caller.activate()
                speaking = asyncio.ensure_future(caller.speak(caller_pcm("caller_booking.wav")[: 4 * RATE]))
                await asyncio.wait_for(caller.first_speech.wait(), 20)
                await await_until(
                    lambda: caller.heard.transcripts, "a transcription from the agent", 10, every=POLL_S
                )
                await speaking
                snapshot = worker.snapshot()
                assert call["room"] in sessions_by_label(snapshot)
                caller.snapshot_text = json.dumps(snapshot)
                return caller, await _participants(server, call["room"])
            finally:
                await caller.leave()

        caller, participants = asyncio.run(phone_call())
        heard = caller.heard
        assert heard.tracks >= 1 and heard.audible_s() > 0.5, heard.summary()
        assert heard.agent_identity in {s for s, _, _ in heard.transcripts}, heard.transcripts
        assert "thank you for calling" in heard.text().lower(), heard.transcripts
        (phone,) = [p for p in participants if p.identity == call["identity"]]
        assert phone.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP  # as the server has it
        assert phone.attributes["sip.callStatus"] == "active"
        assert phone.attributes["sip.phoneNumber"] == CALLER_NUMBER
        # the agent took the caller for a phone caller: the phone concierge, not the web one
        wait_until(
            lambda: "sip caller joined" in worker.log.read_text(), "the job's SIP caller", 5.0, every=POLL_S
        )
        wait_until(lambda: "call ended" in worker.log.read_text(), "the call's end", 10.0, every=POLL_S)
        # the caller's number is in no line of the worker's log (livekit-agents' own records, with their
        # participant and room fields, included) and nowhere in the snapshot
        digits = CALLER_NUMBER.lstrip("+")
        log = worker.log.read_text()
        assert digits not in log and digits not in caller.snapshot_text
        from agent.log_privacy import participant_label

        assert participant_label(call["identity"]) in log  # the caller's identity was there, as its label
        print(
            f"room {call['room']}, identity {call['identity']}, heard {heard.audible_s():.1f} s of speech, "
            f"{len(heard.transcripts)} transcription(s)"
        )
    finally:
        worker.stop()
        agent_sip(server, "teardown", "--name", name, agent_name=worker.agent_name)


# -- a call's life on one worker: hang-up, the agent's own end, a transfer, the keypad, ringing, a call out --

FRONT_DESK = "+15550142"  # fictional: the worker's CHORUS_FRONT_DESK_NUMBER
GUEST = "+15550187"  # fictional: the guest an outbound call reaches


@dataclass
class PhoneWorker:
    """One worker that takes the phone line's calls (its number, TRUNK_NUMBER, set up by `agent sip setup`),
    with a front desk to transfer to."""

    server: Server
    bridge: Path
    worker: Worker
    name: str
    store: Path  # the worker's SQLite hotel

    def script(self, script: dict | None) -> None:
        """The dispatch rule that setup made, with `script` as its agent's job metadata (teacher forcing): the
        bridge's token carries the rule's room configuration, so the next call's agent follows it."""
        from livekit import api

        async def update(lk: api.LiveKitAPI) -> None:
            rules = (await lk.sip.list_dispatch_rule(api.ListSIPDispatchRuleRequest())).items
            (rule,) = [r for r in rules if r.name == self.name]
            info = api.SIPDispatchRuleInfo()
            info.CopyFrom(rule)
            info.ClearField("sip_dispatch_rule_id")
            (agent,) = info.room_config.agents
            agent.metadata = json.dumps({"script": script}) if script else ""
            await lk.sip.update_dispatch_rule(rule.sip_dispatch_rule_id, info)

        asyncio.run(_with_api(self.server, update))

    def call(self, *args: str, script: dict | None = None, caller: str = CALLER_NUMBER) -> dict:
        """An inbound call from `caller` to the hotel's number, as the bridge asks the server for it."""
        self.script(script)
        out = inbound(self.server, self.bridge, "--from", caller, "--to", TRUNK_NUMBER, *args)
        assert out.returncode == 0, (out.stdout, out.stderr)
        return json.loads(out.stdout)

    def log_since(self, mark: int) -> str:
        return self.worker.log.read_bytes()[mark:].decode(errors="replace")

    def mark(self) -> int:
        return self.worker.log.stat().st_size

    def session(self, room: str) -> dict | None:
        return sessions_by_label(self.worker.snapshot()).get(room)


async def _with_api(server: Server, fn):
    from livekit import api

    lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
    try:
        return await fn(lk)
    finally:
        await lk.aclose()


@pytest.fixture(scope="module")
def phone(server, bridge, tmp_path_factory) -> PhoneWorker:
    import datetime as dt

    from tools.seed import seed
    from tools.store import open_store

    store = tmp_path_factory.mktemp("phone")
    with pytest.MonkeyPatch.context() as env:  # a seeded hotel, as tests/conftest.py's store_dir makes one
        env.setenv("CHORUS_DATA_DIR", str(store))
        env.delenv("DATABASE_URL", raising=False)
        with open_store() as hotel:
            seed(hotel, dt.date.today())
    worker = Worker(server, store, slots=2, CHORUS_FRONT_DESK_NUMBER=FRONT_DESK).launch()
    name = f"sipcalls-{uuid.uuid4().hex[:6]}"
    try:
        setup = agent_sip(
            server, "setup", "--number", TRUNK_NUMBER, "--name", name, agent_name=worker.agent_name
        )
        assert setup.returncode == 0, setup.stderr
        worker.start(timeout=120)
        yield PhoneWorker(server, bridge, worker, name, store)
    finally:
        worker.stop()
        agent_sip(server, "teardown", "--name", name, agent_name=worker.agent_name)


class Serve:
    """`sip-bridge serve`: a bridge node on the server's Redis that answers and records the calls the server
    places (`CreateSIPParticipant`) and the transfers it asks for (`TransferSIPParticipant`)."""

    def __init__(self, server: Server, bridge: Path, record: Path, *call_ids: str):
        self.record = record
        args = [a for c in call_ids for a in ("--call-id", c)]
        self.proc = subprocess.Popen(
            [
                str(bridge),
                "serve",
                "--record",
                str(record),
                "--redis",
                os.environ["CHORUS_TEST_LIVEKIT_REDIS"],
            ]
            + ["--url", server.url, "--api-key", server.key, "--api-secret", server.secret, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        assert json.loads(ready or "{}").get("ready"), (ready, self.proc.stderr.read() if ready == "" else "")

    def entries(self, method: str) -> list[dict]:
        if not self.record.exists():
            return []
        lines = self.record.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["method"] == method]

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _call_id() -> str:
    return f"SCL_{uuid.uuid4().hex[:12]}"


def test_when_the_phone_caller_hangs_up_the_agents_slot_is_free_within_2_s(phone):
    """The bridge leaves the room when the phone hangs up (a BYE). The caller speaks through a phone line
    (8 kHz, G.711 mu-law, no RED), which the agent hears."""
    from livekit import api

    call = phone.call()

    async def main() -> tuple[PhoneCaller, float, list]:
        caller = PhoneCaller(phone.server, call)
        await caller.join()
        try:
            await asyncio.wait_for(caller.first_speech.wait(), 30)
            await caller.speak(caller_pcm("caller_booking.wav")[: 3 * RATE])
            heard = phone.session(call["room"])
            assert heard is not None and heard["frames_in"] > 0, heard
            participants = await _participants(phone.server, call["room"])
        finally:
            await caller.leave()
        left = asyncio.get_running_loop().time()
        await await_until(lambda: phone.session(call["room"]) is None, "the slot freed", 2.0, every=POLL_S)
        return caller, asyncio.get_running_loop().time() - left, participants

    caller, freed_after, participants = asyncio.run(main())
    (me,) = [p for p in participants if p.identity == call["identity"]]
    (track,) = [t for t in me.tracks if t.type == api.TrackType.AUDIO]
    assert track.disable_red and track.mime_type == "audio/opus", track  # as the bridge publishes a call
    print(f"slot freed {freed_after:.2f} s after the caller hung up")


def test_the_agents_end_of_call_removes_the_caller_after_the_goodbye_has_played(phone):
    goodbye = " Goodbye, and thank you for calling."
    end = {"at_s": 2.0, "name": "call_control", "arguments": {"action": "end"}, "then": goodbye}
    call = phone.call(script={"greeting": " Hello, Grand Hotel.", "reply_every_s": 0, "calls": [end]})

    async def main() -> PhoneCaller:
        caller = PhoneCaller(phone.server, call)
        await caller.join()
        try:
            await await_until(
                lambda: caller.disconnected, "the caller removed from the room", 40, every=POLL_S
            )
            return caller
        finally:
            await caller.leave()

    caller = asyncio.run(main())
    from livekit import rtc

    at, reason = caller.disconnected
    assert reason in (rtc.DisconnectReason.PARTICIPANT_REMOVED, rtc.DisconnectReason.ROOM_DELETED), reason
    said = [t for _, t, _ in caller.heard.transcripts]
    assert any("goodbye" in t.lower() for t in said), said  # the whole goodbye turn had reached the caller
    last_speech = max(t for t, f in zip(caller.heard.times, caller.heard.frames) if np.abs(f).max() > 300)
    # the caller's audio stream is read by a task of its own: a frame that reached the caller with the removal
    # may be read in the same turn of its loop as the disconnect event, a moment after it (seen: 0.1 ms)
    assert last_speech < at + READ_SLACK_S, (last_speech, at)
    wait_until(lambda: phone.session(call["room"]) is None, "the slot freed", 5.0, every=POLL_S)
    from livekit import api

    rooms = asyncio.run(_with_api(phone.server, lambda lk: lk.room.list_rooms(api.ListRoomsRequest())))
    assert call["room"] not in {r.name for r in rooms.rooms}  # the room is closed too


def test_a_transfer_reaches_the_bridge_with_the_front_desk_and_the_call_id_and_frees_the_slot(
    phone, tmp_path
):
    call_id = _call_id()
    mark = phone.mark()
    transfer = {
        "at_s": 2.0,
        "name": "call_control",
        "arguments": {"action": "transfer"},
        "then": " I am putting you through to the front desk now.",
    }
    with Serve(phone.server, phone.bridge, tmp_path / "bridge.jsonl", call_id) as bridge:
        call = phone.call("--call-id", call_id, script={"reply_every_s": 0, "calls": [transfer]})

        async def main() -> tuple[PhoneCaller, float]:
            caller = PhoneCaller(phone.server, call)
            await caller.join()
            try:
                await await_until(
                    lambda: bridge.entries("TransferSIPParticipant"), "the transfer", 40, every=POLL_S
                )
                referred = asyncio.get_running_loop().time()
                # not before the agent had said so: its words had all reached the caller
                assert "front desk" in caller.heard.text().lower(), caller.heard.transcripts
                # the stand-in leaves the caller in the room (a real bridge leaves once the REFER is done):
                # the agent's part is over, and its slot is free while the caller is still there
                await await_until(  # a wait, not a measure (`freed` is printed)
                    lambda: phone.session(call["room"]) is None, "the slot freed", 10.0, every=POLL_S
                )
                freed = asyncio.get_running_loop().time() - referred
                assert caller.disconnected is None
                return caller, freed
            finally:
                await caller.leave()

        caller, freed = asyncio.run(main())
        (sent,) = bridge.entries("TransferSIPParticipant")
    assert sent["sip_call_id"] == call_id == call["attributes"]["sip.callID"]
    assert sent["transfer_to"] == f"tel:{FRONT_DESK}"
    print(f"slot freed {freed:.2f} s after the bridge took the transfer")
    # the job's last line in the worker's log before the next test reads it (the rooms' processes forward
    # their lines to the worker, which may write one after a line stamped later)
    wait_until(
        lambda: "call ended, the phone call was transferred" in phone.log_since(mark),
        "the job's end",
        10.0,
        every=POLL_S,
    )


def test_keypad_presses_are_counted_without_their_digits_and_0_puts_the_caller_through(phone, tmp_path):
    call_id = _call_id()
    mark = phone.mark()
    with Serve(phone.server, phone.bridge, tmp_path / "bridge.jsonl", call_id) as bridge:
        call = phone.call("--call-id", call_id, script={"reply_every_s": 2.0})

        async def main() -> PhoneCaller:
            caller = PhoneCaller(phone.server, call)
            await caller.join()
            try:
                await asyncio.wait_for(caller.first_speech.wait(), 30)
                for digit in "7#":
                    await caller.press(digit)
                before = caller.heard.audible_samples
                # the call goes on: the agent is still there and speaking
                await await_until(
                    lambda: caller.heard.audible_samples > before + RATE, "more speech", 15, every=POLL_S
                )
                assert phone.session(call["room"]) is not None and not bridge.entries(
                    "TransferSIPParticipant"
                )
                await caller.press("0")
                await await_until(
                    lambda: bridge.entries("TransferSIPParticipant"), "the transfer", 15, every=POLL_S
                )
                # the session closes once the transfer's answer is back through the server: a wait, not a
                # measure (a CI run on a busy machine once took more than 3 s)
                await await_until(
                    lambda: phone.session(call["room"]) is None, "the slot freed", 10.0, every=POLL_S
                )
                # the stand-in leaves the caller in the room: a call handed over is no longer the fleet's to
                # keep served, so no new agent comes to them while its watch looks the room over (each
                # worker's watch marks its rooms every BEAT_S and looks for rooms alone every SWEEP_S)
                await asyncio.sleep(4 * max(BEAT_S, SWEEP_S))
                assert phone.session(call["room"]) is None, "a new agent took the transferred caller"
                return caller
            finally:
                await caller.leave()

        asyncio.run(main())
        (sent,) = bridge.entries("TransferSIPParticipant")
    assert (sent["sip_call_id"], sent["transfer_to"]) == (call_id, f"tel:{FRONT_DESK}")
    wait_until(lambda: "call ended" in phone.log_since(mark), "the call's end", 10.0, every=POLL_S)
    said = messages(phone.log_since(mark))
    presses = [m.split(": ", 1)[1] for m in said if "keypad" in m]
    assert len(presses) == 4, presses  # three presses, and 0's meaning
    assert not any(d in m for m in presses for d in "7#0"), presses  # counted, never the digits
    assert any(m.endswith(": transferred") for m in said), said
    alone = f"room {room_label(call['room'])} had a caller and no live agent"
    assert not any(m.startswith(alone) for m in said), [m for m in said if "room" in m]
    # this call's job ended once, as the transfer, on purpose: not taken for a session that failed under the
    # call (a call of an earlier test may end in the same stretch of the worker's log)
    (transferred,) = [m for m in said if "call ended, the phone call was transferred (" in m]
    job = transferred.split(":", 1)[0]  # "job AJ_...": its rooms' process logs every line with it
    ended = [m for m in said if m.startswith(f"{job}: call ended")]
    assert ended == [transferred], [m for m in said if "call ended" in m]
    assert transferred.endswith(", dtmf 3)"), transferred


def messages(log: str) -> list[str]:
    """The messages of a worker's log lines (livekit-agents writes them as JSON objects, one a line)."""
    out = []
    for line in log.splitlines():
        try:
            out.append(json.loads(line)["message"])
        except (ValueError, KeyError, TypeError):
            out.append(line)
    return out


def test_a_booking_made_on_the_phone_carries_the_callers_number_which_no_log_line_or_snapshot_shows(phone):
    import datetime as dt
    import sqlite3

    check_in = dt.date.today() + dt.timedelta(days=12)
    booking = {  # no contact: the caller's number stands in (sip.phoneNumber)
        "guest_name": "Test Ada Phone",
        "check_in": check_in.isoformat(),
        "nights": 2,
        "guests": 1,
        "room_type": "standard",
    }
    mark = phone.mark()
    number = "+12025550147"  # fictional (555-01xx), and long enough for a booking's contact
    call = phone.call(
        script={"reply_every_s": 0, "calls": [{"at_s": 1.0, "name": "book_room", "arguments": booking}]},
        caller=number,
    )

    def booked() -> list[tuple]:
        with sqlite3.connect(phone.store / "hotel.sqlite3") as db:
            sql = "SELECT contact, check_in, status FROM reservations WHERE guest_name = ?"
            return db.execute(sql, ("Test Ada Phone",)).fetchall()

    async def main() -> str:
        caller = PhoneCaller(phone.server, call)
        await caller.join()
        try:
            await await_until(booked, "the booking", 40, every=POLL_S)
            await await_until(
                lambda: "thanks for waiting" in caller.heard.text().lower(), "the reply", 20, every=POLL_S
            )
            return json.dumps(phone.worker.snapshot())
        finally:
            await caller.leave()

    snapshot = asyncio.run(main())
    assert booked() == [(number, check_in.isoformat(), "confirmed")]
    wait_until(lambda: "call ended" in phone.log_since(mark), "the call's end", 10.0, every=POLL_S)
    digits = number.lstrip("+")
    assert digits not in phone.log_since(mark) and digits not in snapshot


def test_a_ringing_call_is_not_talked_over_the_agent_speaks_once_it_is_answered(phone):
    call = phone.call()

    async def main() -> tuple[PhoneCaller, float]:
        caller = PhoneCaller(phone.server, call, answer_after=None)
        await caller.join()
        try:
            await asyncio.wait_for(caller.first_audio.wait(), 30)  # the agent's track: the bridge answers
            await asyncio.sleep(6.0)  # while the phone still rings
            assert not caller.first_speech.is_set() and not caller.heard.transcripts, caller.heard.summary()
            await caller.activate()
            await asyncio.wait_for(caller.first_speech.wait(), 30)
            spoke = asyncio.get_running_loop().time() - caller.answered_at
            await await_until(lambda: caller.heard.transcripts, "the greeting's words", 10, every=POLL_S)
            return caller, spoke
        finally:
            await caller.leave()

    caller, spoke = asyncio.run(main())
    assert "thank you for calling" in caller.heard.text().lower(), caller.heard.transcripts
    print(f"the agent spoke {spoke:.2f} s after the call was answered")


def test_agent_sip_call_reaches_the_bridge_and_the_agent_speaks_first_with_the_calls_purpose(phone, tmp_path):
    from livekit import api, rtc

    async def trunk(lk: api.LiveKitAPI) -> str:
        info = api.SIPOutboundTrunkInfo(
            name="chorus-calls-out", address="10.99.0.2:5090", numbers=[TRUNK_NUMBER]
        )
        return (
            await lk.sip.create_outbound_trunk(api.CreateSIPOutboundTrunkRequest(trunk=info))
        ).sip_trunk_id

    trunk_id = asyncio.run(_with_api(phone.server, trunk))
    reason = "your room is ready early"
    try:
        with Serve(phone.server, phone.bridge, tmp_path / "bridge.jsonl") as bridge:
            out = agent_sip(
                phone.server,
                "call",
                GUEST,
                "--trunk",
                trunk_id,
                "--reason",
                reason,
                agent_name=phone.worker.agent_name,
            )
            assert out.returncode == 0, (out.stdout, out.stderr)
            (placed,) = bridge.entries("CreateSIPParticipant")
    finally:
        asyncio.run(
            _with_api(
                phone.server, lambda lk: lk.sip.delete_trunk(api.DeleteSIPTrunkRequest(sip_trunk_id=trunk_id))
            )
        )
    assert (placed["sip_trunk_id"], placed["call_to"], placed["number"]) == (trunk_id, GUEST, TRUNK_NUMBER)
    assert placed["wait_until_answered"]  # the command returns once the guest has answered
    room = placed["room"]
    assert room in out.stdout and GUEST not in out.stdout + out.stderr
    dispatches = asyncio.run(_with_api(phone.server, lambda lk: lk.agent_dispatch.list_dispatch(room)))
    # the server lists every room's implicit dispatch (agents without a name) beside the named one
    assert [d.agent_name for d in dispatches if d.agent_name] == [phone.worker.agent_name], dispatches

    callee = {
        "url": placed["url"],
        "room": room,
        "identity": placed["participant_identity"],
        "token": placed["token"],
    }

    async def main() -> PhoneCaller:
        caller = PhoneCaller(phone.server, callee)
        await caller.join()
        try:
            assert caller.room.local_participant.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
            await asyncio.wait_for(caller.first_speech.wait(), 30)  # the callee says nothing: the agent first
            await await_until(lambda: caller.heard.transcripts, "the agent's words", 10, every=POLL_S)
            assert caller.sent_samples == 0
            return caller
        finally:
            await caller.leave()

    said = asyncio.run(main()).heard.text().lower()
    assert "grand hotel calling" in said and reason in said, said
