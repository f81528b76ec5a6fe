"""The phone line: `python -m agent sip` against a protocol fake of LiveKit's API (tests/twirp_fake.py: no
LiveKit server can run here), the live call's transfer and hang-up, and the phone caller's tools.

Requests are checked as the fake decoded them from the wire: method, fields, and the grants of the token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import pytest
from livekit import api

from agent import sip
from agent.hotel import HotelAgent, tool_schemas
from agent.phone import NO_FRONT_DESK, PhoneConcierge, PhoneLine
from agent.playout import PlayoutOutput, WavSink
from agent.room import call_purpose, concierge_for
from agent.settings import AgentSettings
from hotel_support import booking, until
from twirp_fake import FRONT_DESK, KEY, SECRET

HOTEL_NUMBER = "+14155550100"
GUEST_NUMBER = "+447700900123"


def run_sip(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = sip.main(list(argv))
    except SystemExit as e:  # argparse's refusals
        status = int(e.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_setup_makes_one_trunk_and_one_rule_and_running_it_again_creates_nothing(livekit, capsys):
    status, out, err = run_sip(
        capsys, "setup", "--number", "+1 415 555 0100", "--allowed-address", "203.0.113.0/24"
    )
    assert (status, err) == (0, ""), err
    assert livekit.methods() == [
        "ListSIPInboundTrunk",
        "CreateSIPInboundTrunk",
        "ListSIPDispatchRule",
        "CreateSIPDispatchRule",
    ]
    trunk = livekit.calls("CreateSIPInboundTrunk")[0]
    assert trunk.grants["sip"].admin  # SIP admin grant in the request's token
    assert list(trunk.request.trunk.numbers) == [HOTEL_NUMBER]  # normalised to E.164
    assert list(trunk.request.trunk.allowed_addresses) == ["203.0.113.0/24"]
    (trunk_id,) = livekit.trunks
    rule = livekit.calls("CreateSIPDispatchRule")[0].request.dispatch_rule
    assert list(rule.trunk_ids) == [trunk_id]
    # one room per call, named after the number called and a random part (never the caller's number)
    assert rule.rule.WhichOneof("rule") == "dispatch_rule_callee"
    assert rule.rule.dispatch_rule_callee.room_prefix == "call-" and rule.rule.dispatch_rule_callee.randomize
    assert [a.agent_name for a in rule.room_config.agents] == ["chorus-concierge"]
    assert "created" in out and trunk_id in out

    livekit.received.clear()
    status, out, _ = run_sip(capsys, "setup", "--number", HOTEL_NUMBER, "--allowed-address", "203.0.113.7/24")
    assert status == 0
    assert livekit.methods() == ["ListSIPInboundTrunk", "ListSIPDispatchRule"]  # nothing new, nothing changed
    assert out.count("unchanged") == 2
    assert len(livekit.trunks) == 1 and len(livekit.rules) == 1

    # a new provider address updates the same trunk in place
    livekit.received.clear()
    status, out, _ = run_sip(capsys, "setup", "--number", HOTEL_NUMBER, "--allowed-address", "198.51.100.10")
    assert status == 0 and "updated" in out
    assert livekit.methods() == ["ListSIPInboundTrunk", "UpdateSIPInboundTrunk", "ListSIPDispatchRule"]
    assert list(livekit.trunks) == [trunk_id]
    assert list(livekit.trunks[trunk_id].allowed_addresses) == ["198.51.100.10/32"]


def test_list_shows_the_line_and_teardown_removes_only_what_setup_made(livekit, capsys):
    foreign = livekit.add_trunk(
        api.CreateSIPInboundTrunkRequest(
            trunk=api.SIPInboundTrunkInfo(name="front-office", numbers=["+15550001"])
        )
    )
    assert run_sip(capsys, "setup", "--number", HOTEL_NUMBER)[0] == 0
    ours = next(t for t in livekit.trunks if t != foreign.sip_trunk_id)
    (rule_id,) = livekit.rules

    status, out, _ = run_sip(capsys, "list")
    assert status == 0
    assert "inbound trunks: 2" in out and "dispatch rules: 1" in out
    assert f"{ours}  chorus  numbers {HOTEL_NUMBER} (made by setup)" in out
    assert f"{foreign.sip_trunk_id}  front-office" in out and "agents chorus-concierge" in out

    livekit.received.clear()
    status, out, _ = run_sip(capsys, "teardown")
    assert status == 0
    deletes = [
        (r.method, getattr(r.request, "sip_trunk_id", "") or r.request.sip_dispatch_rule_id)
        for r in livekit.received
        if r.method.startswith("Delete")
    ]
    assert deletes == [("DeleteSIPDispatchRule", rule_id), ("DeleteSIPTrunk", ours)]  # the rule first
    assert list(livekit.trunks) == [foreign.sip_trunk_id] and not livekit.rules
    status, out, _ = run_sip(capsys, "teardown")
    assert status == 0 and "nothing to remove" in out


def test_an_outbound_call_dispatches_the_agent_then_dials_into_its_room(livekit, capsys):
    status, out, err = run_sip(
        capsys, "call", GUEST_NUMBER, "--trunk", "ST_out", "--reason", "confirm the booking"
    )
    assert (status, err) == (0, ""), err
    assert livekit.methods() == ["CreateDispatch", "CreateSIPParticipant"]
    dispatch = livekit.calls("CreateDispatch")[0].request
    dial = livekit.calls("CreateSIPParticipant")[0]
    assert dispatch.agent_name == "chorus-concierge" and dispatch.room.startswith("call-out-")
    assert call_purpose(dispatch.metadata) == "confirm the booking"  # what the worker tells the agent
    assert dial.request.room_name == dispatch.room
    assert (dial.request.sip_trunk_id, dial.request.sip_call_to) == ("ST_out", GUEST_NUMBER)
    assert dial.request.wait_until_answered
    assert dial.grants["sip"].call
    assert dispatch.room in out


def test_a_call_that_is_not_answered_is_one_line_and_its_room_is_closed(livekit, capsys):
    livekit.fail(
        "CreateSIPParticipant",
        400,
        "failed_precondition",
        "call rejected",
        {"sip_status_code": "486", "sip_status": "Busy Here"},
    )
    status, out, err = run_sip(capsys, "call", GUEST_NUMBER, "--trunk", "ST_out")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "486 Busy Here" in err and GUEST_NUMBER not in err
    room = livekit.calls("CreateDispatch")[0].request.room
    assert [r.request.room for r in livekit.calls("DeleteRoom")] == [room]


@pytest.mark.parametrize(
    ("env", "argv", "status", "words"),
    [
        (
            {"LIVEKIT_API_SECRET": "a-wrong-secret-that-is-long-enough"},
            ["list"],
            1,
            "refused the credentials",
        ),
        ({"LIVEKIT_URL": ""}, ["list"], 2, "set LIVEKIT_URL"),
        ({"LIVEKIT_URL": "http://127.0.0.1:9"}, ["list"], 1, "cannot reach LiveKit at http://127.0.0.1:9"),
        ({}, ["setup", "--number", "555-0100"], 2, "E.164"),
        ({}, ["setup", "--number", HOTEL_NUMBER, "--allowed-address", "300.1.1.1"], 2, "not an IP address"),
        ({}, ["call", "+1 415", "--trunk", "ST_out"], 2, "E.164"),
    ],
    ids=["wrong-secret", "no-url", "unreachable", "bad-number", "bad-cidr", "bad-callee"],
)
def test_expected_failures_are_one_clear_line_and_a_non_zero_exit(
    livekit, monkeypatch, capsys, env, argv, status, words
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got, out, err = run_sip(capsys, *argv)
    assert got == status and out == ""
    assert words in err and "Traceback" not in err
    assert not livekit.calls("CreateSIPInboundTrunk")


def test_the_command_line_itself_prints_no_traceback(livekit):
    """`python -m agent sip` as an operator runs it, against a server that refuses the key."""
    env = {"PATH": "/usr/bin:/bin", "LIVEKIT_URL": "http://127.0.0.1:9", "LIVEKIT_API_KEY": KEY}
    env["LIVEKIT_API_SECRET"] = SECRET
    done = subprocess.run(
        [sys.executable, "-m", "agent", "sip", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("sip list: cannot reach LiveKit") and "Traceback" not in done.stderr


# -- the live call ---------------------------------------------------------------------------------------


def line_for(livekit_room: str = "call-abc", identity: str = "sip_guest", **kw) -> PhoneLine:
    return PhoneLine(AgentSettings.from_env(dotenv=False), room=livekit_room, identity=identity, **kw)


def call_in_progress(livekit, tmp_path, **kw) -> tuple[PhoneLine, PlayoutOutput]:
    """A phone caller `sip_guest` in room call-abc (as the fake server knows it), and the line and playout of
    the agent's side of the call."""
    livekit._dispatch(api.CreateAgentDispatchRequest(agent_name="a", room="call-abc"))
    livekit.participants["call-abc"] = {"sip_guest"}
    line = line_for(**kw)
    out = PlayoutOutput(WavSink(tmp_path / "o.wav", 22_050))
    line.attach(out)
    return line, out


def test_transfer_waits_for_the_agent_to_say_so_then_refers_the_caller_to_the_front_desk(livekit, tmp_path):
    async def main():
        line, out = call_in_progress(livekit, tmp_path, number=GUEST_NUMBER)
        said = line.request("transfer")
        assert "front desk" in said
        assert line.request("transfer").startswith("The call is already being transferred")
        await asyncio.sleep(0.3)
        assert not livekit.calls("TransferSIPParticipant")  # not before the agent has spoken
        out.on_turn_started()
        await asyncio.sleep(0.2)
        assert not livekit.calls("TransferSIPParticipant")  # not while it speaks
        out.on_turn_ended(False)
        await until(lambda: line.outcome is not None, "the transfer")
        await out.aclose()
        return line

    line = asyncio.run(main())
    assert line.outcome == "transferred"
    (req,) = livekit.calls("TransferSIPParticipant")
    assert (req.request.room_name, req.request.participant_identity) == ("call-abc", "sip_guest")
    assert req.request.transfer_to == f"tel:{FRONT_DESK}"
    assert (
        req.grants["sip"].call and req.grants["video"].room_admin and req.grants["video"].room == "call-abc"
    )


def test_end_call_says_goodbye_then_removes_the_caller_and_closes_the_room(livekit, tmp_path):
    async def main():
        line, out = call_in_progress(livekit, tmp_path)
        assert "goodbye" in line.request("end")
        out.on_turn_started()
        out.on_turn_ended(False)
        await until(lambda: line.outcome is not None, "the hang-up")
        await out.aclose()
        return line

    assert asyncio.run(main()).outcome == "ended"
    assert livekit.methods() == ["RemoveParticipant", "DeleteRoom"]
    assert livekit.calls("RemoveParticipant")[0].request.identity == "sip_guest"
    assert "call-abc" not in livekit.rooms


def test_a_failed_transfer_keeps_the_caller_with_the_agent_and_logs_no_number(livekit, caplog):
    livekit.fail(
        "TransferSIPParticipant",
        400,
        "failed_precondition",
        "transfer failed",
        {"sip_status_code": "486", "sip_status": "Busy Here", "sip_transfer_reason": "STR_BUSY"},
    )

    async def main():
        line = line_for(number=GUEST_NUMBER)  # no output attached: acts at once
        line.request("transfer")
        await line.pending
        return line

    with caplog.at_level(logging.INFO):
        line = asyncio.run(main())
    assert line.outcome.startswith("transfer failed") and "486" in line.outcome
    assert line.action is None  # the model may try again
    assert not livekit.calls("RemoveParticipant")
    assert GUEST_NUMBER not in caplog.text and "7700900123" not in caplog.text


def test_the_jobs_end_drops_a_hand_over_still_waiting_and_lets_one_under_way_finish(livekit, tmp_path):
    async def main():
        waiting, out = call_in_progress(livekit, tmp_path)
        waiting.request("end")
        await asyncio.sleep(0.1)
        await waiting.aclose()  # the caller hung up before the agent said goodbye
        assert waiting.pending.cancelled() and not livekit.calls("RemoveParticipant")
        acting = line_for()  # no output attached: it acts at once
        acting.request("end")
        await until(lambda: acting.acting, "the hang-up to start")
        await acting.aclose()
        await out.aclose()
        return acting

    assert asyncio.run(main()).outcome == "ended"
    assert livekit.methods() == ["RemoveParticipant", "DeleteRoom"]


def test_without_a_front_desk_number_transfer_is_refused_in_words_the_model_can_say(livekit, monkeypatch):
    from livekit.agents import ToolError

    monkeypatch.delenv("CHORUS_FRONT_DESK_NUMBER")
    line = line_for()
    with pytest.raises(ToolError) as e:
        line.request("transfer")
    assert e.value.message == NO_FRONT_DESK and line.action is None


@pytest.fixture
def hotel(sqlite_hotel):
    return sqlite_hotel  # tests/conftest.py


# -- which tools a caller gets ---------------------------------------------------------------------------


def test_call_control_is_offered_to_phone_callers_only_and_both_fit_the_models_five(livekit, hotel):
    settings = AgentSettings.from_env(dotenv=False)
    common = dict(room="call-1", identity="sip_1", job_id="job-1")
    web, no_line = concierge_for(settings, hotel, phone=False, attributes={}, **common)
    phone, line = concierge_for(
        settings,
        hotel,
        phone=True,
        attributes={"sip.phoneNumber": GUEST_NUMBER},
        **common,
        job_metadata=json.dumps({"reason": "confirm tomorrow's arrival"}),
    )
    assert isinstance(web, HotelAgent) and no_line is None
    assert isinstance(phone, PhoneConcierge) and line.number == GUEST_NUMBER
    web_tools = sorted(t["name"] for t in tool_schemas(web))
    phone_tools = sorted(t["name"] for t in tool_schemas(phone))
    assert web_tools == sorted(
        ["check_availability", "book_room", "find_reservation", "change_or_cancel_reservation", "hotel_info"]
    )
    assert phone_tools == sorted(
        ["check_availability", "book_room", "manage_reservation", "hotel_info", "call_control"]
    )
    book = next(t for t in tool_schemas(phone) if t["name"] == "book_room")
    assert "contact" not in book["parameters"]["required"]  # the caller's number stands in
    assert "call_control" in phone.instructions and "call_control" not in web.instructions
    assert "confirm tomorrow's arrival" in phone.instructions and GUEST_NUMBER not in phone.instructions


def test_a_phone_booking_uses_the_callers_number_and_one_tool_finds_changes_and_cancels(hotel, caplog):
    settings = AgentSettings.from_env(dotenv=False)
    line = PhoneLine(settings, room="call-1", identity="sip_1", number=GUEST_NUMBER)
    agent = PhoneConcierge(hotel, line, instructions="test")
    args = booking(guest_name="Grace Hopper")
    del args["contact"]

    async def main():
        made = json.loads(await agent.book_room(args, None))
        code = made["confirmation_code"]
        found = json.loads(
            await agent.manage_reservation(
                {"confirmation_code": code, "last_name": "Hopper", "action": "find"}, None
            )
        )
        moved = json.loads(
            await agent.manage_reservation(
                {"confirmation_code": code, "last_name": "Hopper", "action": "change", "nights": 3}, None
            )
        )
        gone = json.loads(
            await agent.manage_reservation(
                {"confirmation_code": code, "last_name": "Hopper", "action": "cancel"}, None
            )
        )
        return code, found, moved, gone

    with caplog.at_level(logging.DEBUG):
        code, found, moved, gone = asyncio.run(main())
    (row,) = hotel.reservations()
    assert row.code == code and row.contact == GUEST_NUMBER and row.status == "cancelled"
    assert found["confirmation_code"] == code and "message" in moved and "message" in gone
    assert GUEST_NUMBER not in caplog.text
