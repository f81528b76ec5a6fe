"""The phone line against a protocol fake of LiveKit's API (tests/twirp_fake.py), for what a real server
cannot be made to produce here, and the phone caller's tools.

Everything a real LiveKit server with Redis can serve runs against one: `sip setup/list/teardown`, a wrong
secret and an outbound call no bridge places (tests/test_livekit_sip.py); calls through the server's SIP
machinery with scripts/sip-bridge standing in for the bridge's control plane: an inbound call, a hang-up,
the agent's own end of call, a transfer, the keypad, ringing, and `sip call` (tests/test_sip_bridge.py). What
stays here: refusals that come from a SIP bridge and a carrier (a callee who is busy, a transfer the far end
refuses; the stand-in answers every call and transfer), requests that must never be sent, and moments of a
call that a real caller's timing cannot pin down. Requests are checked as the fake decoded them from the wire:
method, fields, and the grants of the token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import pytest
from livekit import api

from agent.audio_out.playout import PlayoutOutput
from agent.audio_out.sinks import WavSink
from agent.concierge import concierge_for
from agent.hotel import HotelAgent, tool_schemas
from agent.phone import sip
from agent.phone.phone import NO_FRONT_DESK, PhoneConcierge, PhoneLine
from agent.settings import AgentSettings
from hotel_support import booking
from twirp_fake import KEY, SECRET
from wait_support import await_until

HOTEL_NUMBER = "+14155550100"
GUEST_NUMBER = "+447700900123"


def run_sip(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = sip.main(list(argv))
    except SystemExit as e:  # argparse's refusals
        status = int(e.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_a_call_that_is_not_answered_is_one_line_and_its_room_is_closed(livekit, capsys):
    """A callee's refusal and its SIP status (486 Busy Here) come from a bridge and a carrier; the
    stand-in answers every call it is asked to place, so the fake refuses this one. (With no bridge at all,
    the real server's refusal: tests/test_livekit_sip.py.)"""
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
        ({"LIVEKIT_URL": ""}, ["list"], 2, "set LIVEKIT_URL"),
        ({"LIVEKIT_URL": "http://127.0.0.1:9"}, ["list"], 1, "cannot reach LiveKit at http://127.0.0.1:9"),
        ({}, ["setup", "--number", "555-0100"], 2, "E.164"),
        ({}, ["setup", "--number", HOTEL_NUMBER, "--allowed-address", "300.1.1.1"], 2, "not an IP address"),
        ({}, ["call", "+1 415", "--trunk", "ST_out"], 2, "E.164"),
    ],
    ids=["no-url", "unreachable", "bad-number", "bad-cidr", "bad-callee"],
)
def test_expected_failures_are_one_clear_line_and_a_non_zero_exit(
    livekit, monkeypatch, capsys, env, argv, status, words
):
    """Refused before any request (bad arguments or settings) or with nothing listening; the fake records
    every request, so it shows that none went out. A wrong secret is refused by the real server
    (tests/test_livekit_sip.py)."""
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


def test_a_failed_transfer_keeps_the_caller_with_the_agent_and_logs_no_number(livekit, caplog):
    """A transfer the far end refuses (the REFER answered 486) comes from a bridge and a carrier; the
    stand-in accepts every transfer, so the fake refuses this one."""
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
    """The job ends at two exact moments of a hand-over (before the goodbye, and while the removal is
    under way), which a real caller's timing cannot pin down; the fake records that no removal went out for
    the first."""

    async def main():
        waiting, out = call_in_progress(livekit, tmp_path)
        waiting.request("end")
        await asyncio.sleep(0.1)
        await waiting.aclose()  # the caller hung up before the agent said goodbye
        assert waiting.pending.cancelled() and not livekit.calls("RemoveParticipant")
        acting = line_for()  # no output attached: it acts at once
        acting.request("end")
        await await_until(lambda: acting.acting, "the hang-up to start")
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


# -- the keypad and scripted calls, with no server -------------------------------------------------------


def test_keypad_presses_are_counted_and_only_0_with_a_front_desk_acts(monkeypatch, caplog):
    """Through a real server in tests/test_sip_bridge.py; here what needs none: a key without a meaning, and 0
    when there is no front desk to put the caller through to, change nothing in the call."""
    monkeypatch.delenv("CHORUS_FRONT_DESK_NUMBER", raising=False)

    async def main() -> PhoneLine:
        line = line_for(number=GUEST_NUMBER, front_desk=None)
        for digit in "5*0#":
            line.on_dtmf(digit)
        return line

    with caplog.at_level(logging.INFO):
        line = asyncio.run(main())
    assert line.dtmf == 4 and line.action is None and line.pending is None
    presses = [r.getMessage() for r in caplog.records if "keypad" in r.getMessage()]
    assert len(presses) == 4 and not any(d in p.split(": ", 1)[1] for p in presses for d in "5*0#"), presses


def test_a_script_names_the_words_after_a_tool_and_a_placed_call_is_greeted_with_its_reason():
    from agent.forcing import AFTER_TOOL, CALLING, GREETING, Script

    end = {"at_s": 2, "name": "call_control", "arguments": {"action": "end"}, "then": " Goodbye."}
    script = Script.from_metadata(json.dumps({"script": {"calls": [end, {"at_s": 1, "name": "hotel_info"}]}}))
    assert [(c["name"], c["then"]) for c in script.calls] == [
        ("hotel_info", AFTER_TOOL),
        ("call_control", " Goodbye."),
    ]
    assert script.greeting == GREETING
    placed = Script.from_metadata(json.dumps({"direction": "outbound", "reason": " your room is ready "}))
    assert placed.greeting == f"{CALLING} your room is ready"
    assert Script.from_metadata(json.dumps({"direction": "outbound", "reason": ""})).greeting == CALLING
    # a scripted greeting still wins, and a bad `then` is a bad script: the default one
    mine = Script.from_metadata(json.dumps({"direction": "outbound", "script": {"greeting": " Hi."}}))
    assert mine.greeting == " Hi."
    bad = Script.from_metadata(json.dumps({"script": {"calls": [{**end, "then": ""}]}}))
    assert bad.calls == [] and bad.greeting == GREETING
