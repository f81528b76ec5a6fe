"""Phone callers: the concierge they get, and the live call's controls (transfer, hang-up)
through LiveKit's API.

LiveKit's SIP bridge puts a caller in a room as a participant of kind SIP, with their number in the attribute
`sip.phoneNumber` (absent when withheld). `PhoneConcierge` is their agent. The model takes at most five tools
and the hotel already uses five, so on the phone the reservation's three steps are one tool
(`manage_reservation`, tools/schemas.py) and the fifth place is `call_control`: transfer to the front desk, or
end the call. The model tells the caller first; `PhoneLine` acts once that turn has played, at most
`HANDOFF_WAIT_S` later, through LiveKit's server API as agent/lkapi.py bounds it: a hand-over the server
does not answer in time fails like one it refuses. The caller's number prefills a booking's contact and is
never logged.
Knows livekit-agents and LiveKit's server API; the hotel only through agent/hotel.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Literal

from livekit import api
from livekit.agents import RunContext, ToolError, function_tool
from pydantic import Field, ValidationError

from agent import call_trace
from agent.call import room_label
from agent.hotel import Concierge, concierge_instructions, hotel_tool
from agent.lkapi import LiveKit, LiveKitFailure, bound_s
from prompts import load_prompt
from tools import schemas
from tools.hotel import Hotel

if TYPE_CHECKING:
    from agent.audio_out.playout import PlayoutOutput
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.phone")

PHONE_NUMBER_ATTRIBUTE = "sip.phoneNumber"  # set by LiveKit's SIP bridge on the caller's participant
HANDOFF_WAIT_S = 15.0  # the longest the line waits for the model's words before it transfers or hangs up
HANG_UP = ("remove_participant", "delete_room")  # the API calls a hang-up makes
TRANSFER = ("transfer_sip_participant",)
FRONT_DESK_KEY = "0"  # the keypad key that puts a phone caller through to the front desk
CALL_STATUS_ATTRIBUTE = "sip.callStatus"  # set by the bridge: dialing, ringing, automation, active, hangup
NOT_YET_ANSWERED = ("dialing", "ringing", "automation")  # nothing the agent says reaches the phone yet

NO_FRONT_DESK = (
    "There is no front desk line to transfer to right now. Apologise, and keep helping the caller yourself."
)
ALREADY = "The call is already being {}; say nothing more about it."
SAY_FIRST = {
    "transfer": "Tell the caller you are putting them through to the front desk now. The call is handed over "
    "when you finish speaking.",
    "end": "Say a short goodbye to the caller. The call ends when you finish speaking.",
}


class CallControl(schemas.ToolArgs):
    """Transfer the caller to the hotel's front desk, or end the call once the caller is done. Tell the
    caller first; the line is handed over or hung up when you finish speaking."""

    action: Literal["transfer", "end"] = Field(
        title="action", description="transfer to put the caller through to the front desk, end to hang up."
    )


def book_room_schema() -> dict[str, Any]:
    """`book_room` as a phone caller sees it: the contact may be left out, for the number they call from."""
    schema = json.loads(json.dumps(schemas.tool_schema("book_room")))
    params = schema["parameters"]
    params["required"] = [name for name in params["required"] if name != "contact"]
    params["properties"]["contact"]["description"] = (
        "Phone number of the guest, with + and the country code, or their email address; leave it out to use "
        "the number the caller is calling from."
    )
    return schema


class PhoneLine:
    """One phone call's controls: the room and caller it concerns, the front desk it may hand over to, and
    the agent's output, whose next turn is awaited before the line is handed over or hung up."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        room: str,
        identity: str,
        number: str | None = None,
        front_desk: str | None = None,
    ) -> None:
        self.settings = settings
        self.room = room
        self.identity = identity
        self.number = number or None  # the caller's number: personal data, never logged
        self.front_desk = front_desk if front_desk is not None else settings.front_desk_number
        self.output: PlayoutOutput | None = None
        self.pending: asyncio.Task | None = None
        self.action: str | None = None
        self.outcome: str | None = None  # "transferred", "ended", or why it failed
        self.acting = False
        self.finished = asyncio.Event()  # the caller was handed over or hung up: the agent's part is done
        self.dtmf = 0  # keypad presses the caller sent in this call (counted; their digits never logged)

    def attach(self, output: PlayoutOutput) -> None:
        """The call's playout, whose turns `after_goodbye` waits for (set once the call has started)."""
        self.output = output

    async def transfer(self) -> None:
        """Hand the caller to the front desk (a SIP REFER through LiveKit); the caller leaves the room."""
        if self.front_desk is None:
            raise ValueError("no front desk number (CHORUS_FRONT_DESK_NUMBER)")
        async with LiveKit(self.settings) as lk:
            await lk.call(
                lk.api.sip.transfer_sip_participant,
                api.TransferSIPParticipantRequest(
                    room_name=self.room,
                    participant_identity=self.identity,
                    transfer_to=f"tel:{self.front_desk}",
                    play_dialtone=False,
                ),
            )

    async def hang_up(self) -> None:
        """Remove the caller (the phone call ends) and close the room; LiveKitFailure if the server refuses
        or does not answer. A server that did not answer the removal is not asked to close the room."""
        async with LiveKit(self.settings) as lk:
            try:
                await lk.call(
                    lk.api.room.remove_participant,
                    api.RoomParticipantIdentity(room=self.room, identity=self.identity),
                )
            except LiveKitFailure as e:
                if e.error is None:
                    raise
                # the server answered (the caller already gone): the room still closes
            await lk.call(lk.api.room.delete_room, api.DeleteRoomRequest(room=self.room))

    def bound_s(self) -> float:
        """The longest a transfer or hang-up may take once it has begun."""
        return max(bound_s(self.settings, *TRANSFER), bound_s(self.settings, *HANG_UP))

    def request(self, action: Literal["transfer", "end"]) -> str:
        """The model asked for `action`: what it is to say now. The action itself runs after that."""
        if self.action is not None:
            return ALREADY.format("transferred" if self.action == "transfer" else "ended")
        if action == "transfer" and self.front_desk is None:
            raise ToolError(NO_FRONT_DESK)
        self.action = action
        self.pending = asyncio.get_running_loop().create_task(self.after_goodbye(action), name="chorus.phone")
        return SAY_FIRST[action]

    async def after_goodbye(self, action: Literal["transfer", "end"]) -> None:
        """Once the model's next turn has played (or `HANDOFF_WAIT_S`), `act`."""
        if self.output is not None:
            await self.output.after_next_turn(HANDOFF_WAIT_S)
        await self.act(action)

    async def act(self, action: Literal["transfer", "end"]) -> None:
        """Transfer or hang up now, within `bound_s()`; never raises for LiveKit's sake. A failure (refused,
        or no answer in time) is the outcome, logged without the caller's number; a transfer that fails leaves
        the caller with the agent, and the model may ask again."""
        self.acting = True  # from here the call is handed over or hung up even if the job ends meanwhile
        span = "chorus.phone.transfer" if action == "transfer" else "chorus.phone.hangup"
        try:
            with call_trace.current().step(span):
                if action == "transfer":
                    await self.transfer()
                    self.outcome = "transferred"
                else:
                    await self.hang_up()
                    self.outcome = "ended"
            log.info("phone call in room %s: %s", room_label(self.room), self.outcome)
            self.finished.set()
        except LiveKitFailure as e:
            self.outcome = f"{action} failed: {e}"
            self.action, self.acting = None, False  # the model may try again
            log.warning("phone call in room %s: %s", room_label(self.room), self.outcome)

    def on_dtmf(self, digit: str) -> None:
        """A keypad press from the caller (a SIP DTMF packet): counted, logged without its digit, and
        `FRONT_DESK_KEY` puts the caller through to the front desk at once (when there is one and the call is
        not already being handed over or hung up). Any other key, or one that cannot be acted on, changes
        nothing in the call."""
        self.dtmf += 1
        log.info("phone call in room %s: a keypad press (%d in this call)", room_label(self.room), self.dtmf)
        if digit == FRONT_DESK_KEY and self.front_desk is not None and self.action is None:
            log.info(
                "phone call in room %s: the caller asked for the front desk by keypad", room_label(self.room)
            )
            self.action = "transfer"
            self.pending = asyncio.get_running_loop().create_task(self.act("transfer"), name="chorus.phone")

    async def aclose(self) -> None:
        """At the job's end: a hand-over still waiting for the agent's words is dropped; one already under way
        (the caller removed, the room being closed) is let finish."""
        if self.pending is None or self.pending.done():
            return
        if not self.acting:
            self.pending.cancel()
        await asyncio.wait([self.pending], timeout=self.bound_s())  # neither cancels it nor raises its error


ANSWER_WAIT_S = 60.0  # the longest a job waits for a ringing call to be answered before it starts anyway


async def answered(room: Any, identity: str, timeout: float = ANSWER_WAIT_S) -> bool:
    """Until the SIP participant `identity` in `room` has a call that is answered: its `sip.callStatus` is no
    longer dialing, ringing or automation (True; at once when it never was, or has no such attribute), or it
    left the room (False), or `timeout` passed (True: a bridge that never says so is not waited for longer).
    The bridge answers the phone once it has subscribed to a track in the room, so the agent's track is
    published before this wait; what the agent said while the phone still rang would be lost."""

    def status() -> str | None:
        p = room.remote_participants.get(identity)
        return None if p is None else p.attributes.get(CALL_STATUS_ATTRIBUTE, "")

    now = status()
    if now is None:
        return False
    if now not in NOT_YET_ANSWERED:
        return True
    changed = asyncio.Event()

    def wake(*_args: Any) -> None:
        changed.set()

    room.on("participant_attributes_changed", wake)
    room.on("participant_disconnected", wake)
    room.on("disconnected", wake)
    log.info("phone call in room %s: waiting for the call to be answered", room_label(room.name))
    try:
        async with asyncio.timeout(timeout):
            while (now := status()) in NOT_YET_ANSWERED and room.isconnected():
                changed.clear()
                await changed.wait()
    except TimeoutError:
        log.warning(
            "phone call in room %s: not answered within %.0f s; the agent starts",
            room_label(room.name),
            timeout,
        )
        return True
    finally:
        room.off("participant_attributes_changed", wake)
        room.off("participant_disconnected", wake)
        room.off("disconnected", wake)
    return now is not None and room.isconnected()


def phone_instructions(hotel: Hotel, line: PhoneLine, purpose: str = "") -> str:
    """The concierge prompt with what a phone call adds: the caller's number, call control, and why the
    hotel called when it did."""
    contact = (
        "Their number is on file: a booking uses it as the contact unless they give another."
        if line.number
        else "Their number is withheld: ask for a phone number or email address when booking."
    )
    reason = f"You placed this call to the guest: {purpose.strip()}" if purpose.strip() else ""
    phone = load_prompt("phone", contact=contact, purpose=reason)
    return f"{concierge_instructions(hotel)}\n\n{phone}"


class PhoneConcierge(Concierge):
    """A phone caller's concierge: availability, booking (the contact prefilled from the caller's number),
    one reservation tool, hotel questions, and call control (`tools.schemas.PHONE_TOOLS` + `call_control`)."""

    def __init__(
        self,
        hotel: Hotel,
        line: PhoneLine,
        *,
        purpose: str = "",
        instructions: str | None = None,
        session_key: str | None = None,
    ) -> None:
        self.line = line
        super().__init__(
            hotel,
            instructions=instructions
            if instructions is not None
            else phone_instructions(hotel, line, purpose),
            session_key=session_key,
        )

    @function_tool(raw_schema=book_room_schema())
    async def book_room(self, raw_arguments: dict[str, object], context: RunContext) -> str:
        arguments = raw_arguments
        if isinstance(raw_arguments, dict) and not raw_arguments.get("contact") and self.line.number:
            arguments = {**raw_arguments, "contact": self.line.number}
        return await self._call("book_room", arguments, context)

    manage_reservation = hotel_tool("manage_reservation")

    @function_tool(raw_schema=schemas.function_schema("call_control", CallControl))
    async def call_control(self, raw_arguments: dict[str, object], context: RunContext) -> str:
        try:
            args = CallControl.model_validate(raw_arguments)
        except ValidationError as e:
            raise ToolError(schemas.explain(CallControl, e)) from None
        return json.dumps({"message": self.line.request(args.action)})
