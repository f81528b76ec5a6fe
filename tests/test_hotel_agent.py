"""The concierge agent's real `@function_tool` methods, run by a real livekit-agents `AgentSession`
(a scripted LLM stands in for the model): outputs, `ToolError` messages and the rows they leave."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import date

import pytest
from livekit.agents import AgentSession, ToolError, llm
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN

import hotel_support
from agent.hotel import (
    MAX_FAILED_LOOKUPS,
    SYSTEM_TROUBLE,
    TOO_MANY_LOOKUPS,
    HotelAgent,
    tool_schemas,
)
from hotel_support import booking
from prompts import PROMPTS_DIR
from tools import schemas
from tools.audit import audit
from tools.hotel import Hotel


@pytest.fixture(params=hotel_support.BACKENDS)
def store(request, tmp_path):
    with hotel_support.seeded_store(request.param, tmp_path) as s:
        yield s


class ScriptedLLM(llm.LLM):
    """Plays the model: each turn of the session takes the next step, either a reply (str) or a tool
    call (name, arguments as a dict or a raw JSON string). Keeps the chat contexts it was shown."""

    def __init__(self, steps: list[object]):
        super().__init__()
        self.steps = list(steps)
        self.contexts: list[llm.ChatContext] = []
        self.tool_names: list[list[str]] = []

    def chat(
        self,
        *,
        chat_ctx,
        tools=None,
        conn_options=DEFAULT_API_CONNECT_OPTIONS,
        parallel_tool_calls=NOT_GIVEN,
        tool_choice=NOT_GIVEN,
        extra_kwargs=NOT_GIVEN,
    ):
        self.contexts.append(chat_ctx.copy())
        self.tool_names.append(sorted(t.info.name for t in tools or []))
        step = self.steps.pop(0) if self.steps else "Is there anything else?"
        return _Step(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options, step=step)


class _Step(llm.LLMStream):
    def __init__(self, owner: ScriptedLLM, *, step: object, **kwargs):
        super().__init__(owner, **kwargs)
        self._step = step

    async def _run(self) -> None:
        if isinstance(self._step, str):
            delta = llm.ChoiceDelta(role="assistant", content=self._step)
        else:
            name, arguments = self._step  # type: ignore[misc]
            raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
            call = llm.FunctionToolCall(name=name, arguments=raw, call_id=f"call_{id(self)}")
            delta = llm.ChoiceDelta(role="assistant", tool_calls=[call])
        self._event_ch.send_nowait(llm.ChatChunk(id="chunk", delta=delta))


def converse(hotel: Hotel, turns: list[tuple[str, list[object]]]) -> tuple[list[list[object]], ScriptedLLM]:
    """Run a session: for each (user says, model steps) turn, the events the session produced."""

    async def main():
        model = ScriptedLLM([step for _, steps in turns for step in steps])
        events = []
        async with AgentSession(llm=model) as session:
            await session.start(HotelAgent(hotel, instructions="You are a test concierge."))
            for said, _ in turns:
                result = await session.run(user_input=said)
                events.append(list(result.events))
        return events, model

    return asyncio.run(main())


def outputs(events: list[object]) -> list[llm.FunctionCallOutput]:
    return [e.item for e in events if e.type == "function_call_output"]


def test_a_booking_through_the_session_then_the_sold_out_answer(store):
    hotel = hotel_support.hotel(store)
    (first, second), model = converse(
        hotel,
        [
            (
                "I'd like the deluxe room on the 12th for two nights.",
                [("book_room", booking()), "You're booked."],
            ),
            (
                "Book another one for my friend.",
                [("book_room", booking(guest_name="Mary Somerville")), "Sorry."],
            ),
        ],
    )
    (done,) = outputs(first)
    assert done.is_error is False
    result = json.loads(done.output)
    assert result["message"].startswith("Booked: Deluxe King for Ada Lovelace")
    (refused,) = outputs(second)
    assert refused.is_error is True
    assert refused.output == (
        "No Deluxe King rooms are left on Tuesday the 12th; a Standard Queen is available for those dates "
        "at $229.50 including tax."
    )
    # the model saw the error text as the tool's output before it answered
    last_ctx = model.contexts[-1]
    assert any(i.type == "function_call_output" and i.output == refused.output for i in last_ctx.items)
    assert model.tool_names[0] == sorted(schemas.WEB_TOOLS)
    rows = store.transact(lambda tx: tx.reservations())
    assert [(r.code, r.guest_name) for r in rows] == [(result["confirmation_code"], "Ada Lovelace")]
    assert audit(store) == []


def test_the_same_booking_repeated_by_the_model_books_once(store):
    hotel = hotel_support.hotel(store)
    (first, second), _ = converse(
        hotel,
        [
            ("Book it.", [("book_room", booking()), "Done."]),
            ("Did that go through? Book it again to be sure.", [("book_room", booking()), "Yes, it did."]),
        ],
    )
    a, b = json.loads(outputs(first)[0].output), json.loads(outputs(second)[0].output)
    assert a["confirmation_code"] == b["confirmation_code"] and b["already_booked"] is True
    assert len(store.transact(lambda tx: tx.reservations())) == 1


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (booking(guests=-1), "The number of guests must be between 1 and 12."),
        (booking(guest_name="x" * 10_000), "The guest name is too long; it can be at most 80 characters."),
        (booking(check_in="2030-02-30"), "The check-in date 2030-02-30 does not exist on the calendar."),
        (booking(guest_name="Robert'); DROP TABLE reservations;--"), "The guest name is not valid"),
        (
            '{"guest_name": "Ada", "guests": "two"',
            "The number of guests must be a whole number.",
        ),  # cut-off JSON
        ("[1, 2]", "Error parsing arguments"),  # the framework's own refusal, still a readable error
        # digits int() rejects (Ethiopic numerals are digits, not decimals) and days no calendar can hold:
        # a request to say the date again, not "the reservation system has a problem"
        (booking(check_in="\u1369"), "I could not read the check-in date"),
        (booking(check_in="March \u1369\u136a"), "I could not read the check-in date"),
        (booking(check_in="March 99999999999999999999"), "does not exist on the calendar"),
        (booking(check_in="March 12 99999999999999999999"), "does not exist on the calendar"),
        (booking(check_in="2030-03-12", check_out="99999999999999999999"), "does not exist on the calendar"),
        # the limit counts the name as stored: U+0958 is two characters once NFC-normalised
        (booking(guest_name="\u0958" * 80), "The guest name must be at most 80 characters long."),
    ],
)
def test_bad_arguments_come_back_as_tool_errors_the_model_reads(store, arguments, expected):
    (events,), _ = converse(hotel_support.hotel(store), [("Book it.", [("book_room", arguments), "Sorry."])])
    (out,) = outputs(events)
    assert out.is_error is True and expected in out.output, out.output
    assert len(out.output) < 400
    assert store.transact(lambda tx: tx.reservations()) == []


def test_lookup_change_and_cancel_through_the_session(store):
    hotel = hotel_support.hotel(store)
    code = hotel.book_room(booking(room_type="standard"))["confirmation_code"]
    key = {"confirmation_code": code, "last_name": "lovelace"}
    turns, _ = converse(
        hotel,
        [
            ("Can you find my booking?", [("find_reservation", key), "Found it."]),
            (
                "Move it to the suite.",
                [
                    ("change_or_cancel_reservation", {**key, "action": "change", "room_type": "suite"}),
                    "Done.",
                ],
            ),
            (
                "Actually cancel it.",
                [("change_or_cancel_reservation", {**key, "action": "cancel"}), "Cancelled."],
            ),
            ("Is breakfast included?", [("hotel_info", {"topic": "breakfast"}), "It is not."]),
        ],
    )
    found, changed, cancelled, info = (json.loads(outputs(t)[0].output) for t in turns)
    assert found["status"] == "confirmed" and found["room_type"] == "Standard Queen"
    assert changed["room_type"] == "Family Suite"
    assert cancelled["status"] == "cancelled"
    assert "Breakfast" in info["answer"]
    r = store.transact(lambda tx: tx.reservation(code))
    assert (r.status, r.room_type) == ("cancelled", "family_suite")
    assert audit(store) == []


def test_guessing_codes_is_cut_off_after_a_few_misses(store):
    agent = HotelAgent(hotel_support.hotel(store), instructions="test")

    async def guess(code: str) -> str:
        try:
            return await agent.find_reservation({"confirmation_code": code, "last_name": "Lovelace"}, None)
        except ToolError as err:
            return err.message

    real = hotel_support.hotel(store).book_room(booking())["confirmation_code"]

    async def main():
        misses = [await guess("ACDEFHJ" + c) for c in "KMNPR"[:MAX_FAILED_LOOKUPS]]
        return misses, await guess(real)

    misses, after = asyncio.run(main())
    assert all("couldn't find a reservation" in m for m in misses)
    assert after == TOO_MANY_LOOKUPS  # even the right code: the caller is sent to the front desk


def test_an_unexpected_failure_is_a_tool_error_without_details(store, monkeypatch, caplog):
    hotel = hotel_support.hotel(store)
    agent = HotelAgent(hotel, instructions="test")

    def broken(*args, **kwargs):
        raise RuntimeError("connection to server at 10.0.0.5 failed for Ada Lovelace")

    monkeypatch.setattr(hotel, "call", broken)
    with pytest.raises(ToolError) as err:
        asyncio.run(agent.book_room(booking(), None))
    assert err.value.message == SYSTEM_TROUBLE
    assert "Lovelace" not in caplog.text  # logs carry ids, not guest data


@pytest.mark.parametrize("backend", hotel_support.BACKENDS)
def test_the_agent_exposes_the_five_tool_schemas_and_its_hotels_prompt(backend, tmp_path):
    """The default instructions are prompts/concierge.md filled in for this hotel: the name stored in its
    database and its today, spoken; the reader comment gone, every other line as written."""
    day = date(2030, 11, 29)
    policy = replace(hotel_support.TEST_HOTEL.policy, name="The Quillfeather Inn")
    data = replace(hotel_support.TEST_HOTEL, policy=policy)
    with hotel_support.seeded_store(backend, tmp_path, data=data, today=day) as store:
        agent = HotelAgent(Hotel(store, today=lambda: day))
        schemas_shown = tool_schemas(agent)
    assert sorted(schemas_shown, key=lambda t: t["name"]) == sorted(
        schemas.tool_specs(), key=lambda t: t["name"]
    )
    text = agent.instructions
    assert text.startswith(
        "You are the phone concierge of The Quillfeather Inn. Today is Friday, November 29, 2030.\n"
    )
    written = (PROMPTS_DIR / "concierge.md").read_text(encoding="utf-8")
    body = written.split("-->", 1)[1].strip()
    assert text == body.replace("{{hotel_name}}", "The Quillfeather Inn").replace(
        "{{today}}", "Friday, November 29, 2030"
    )
    assert not any(mark in text for mark in ("{{", "}}", "<!--", "-->", "Larkspur"))
