"""A tool's answer as the JSON text the model reads (`tools.replies.ResultWriter`): a hotel answer is written
as it is; one nested 100,000 deep, as objects or as JSON text, one too large, or one with a value JSON has no
form for is refused with a sentence the model can read, never a RecursionError, and counted.
"""

from __future__ import annotations

import json
from datetime import date

import pytest

import hotel_support
from tools.errors import HotelError
from tools.replies import RESULT_MAX_DEPTH, RESULT_MAX_PARTS, ResultWriter


def nested(levels: int) -> dict:
    """{"message": ..., "detail": [[[...]]]}: the answer an object `levels` deep (its own level counted)."""
    inner: list = []
    for _ in range(levels - 2):
        inner = [inner]
    return {"message": "Here it is.", "detail": inner}


def test_a_hotel_answer_is_written_as_the_json_it_is(tmp_path):
    writer = ResultWriter()
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        answer = hotel_support.hotel(store).call(
            "check_availability", {"check_in": "2030-03-12", "nights": 2, "guests": 2}
        )
    text = writer.text(answer)
    assert json.loads(text) == answer
    assert writer.stats() == {"written": 1, "refused": 0}


def test_an_answer_nested_100000_deep_is_refused_with_a_sentence_not_a_recursion_error():
    writer = ResultWriter()
    with pytest.raises(HotelError) as raised:
        writer.text(nested(100_000))
    assert raised.value.message == (
        f"The tool's answer could not be read: it is nested more than {RESULT_MAX_DEPTH} levels deep. "
        "Tell the caller this cannot be looked up right now."
    )
    assert writer.stats() == {"written": 0, "refused": 1}


def test_json_text_nested_100000_deep_is_refused_before_anyone_parses_it():
    writer = ResultWriter()
    with pytest.raises(HotelError, match=f"nested more than {RESULT_MAX_DEPTH} levels deep"):
        writer.text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(HotelError, match="nested more than"):
        writer.text('{"message": "x", "a": ' + '{"b": ' * 100_000 + "1" + "}" * 100_001)
    assert writer.stats() == {"written": 0, "refused": 2}


def test_brackets_inside_strings_are_text_not_depth():
    writer = ResultWriter()
    answer = {"message": "[" * 1000 + '{"' + "\\" * 3, "note": "}" * 500}
    assert json.loads(writer.text(json.dumps(answer))) == answer
    assert json.loads(writer.text(answer)) == answer
    assert writer.stats() == {"written": 2, "refused": 0}


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "text"])
def test_the_deepest_answer_written_is_read_back_and_one_level_more_is_refused(as_text):
    writer = ResultWriter()
    deepest, deeper = nested(RESULT_MAX_DEPTH), nested(RESULT_MAX_DEPTH + 1)
    if as_text:
        deepest, deeper = json.dumps(deepest), json.dumps(deeper)
    assert json.loads(writer.text(deepest)) == (json.loads(deepest) if as_text else deepest)
    with pytest.raises(HotelError, match="nested more than"):
        writer.text(deeper)
    assert writer.stats() == {"written": 1, "refused": 1}


def test_an_answer_too_large_or_with_no_json_form_is_refused_and_counted():
    writer = ResultWriter()
    with pytest.raises(HotelError, match=f"more than {RESULT_MAX_PARTS:,} parts"):
        writer.text({"message": "many", "rows": list(range(RESULT_MAX_PARTS))})
    with pytest.raises(HotelError, match="a value that has no JSON form"):
        writer.text({"message": "a date", "when": date(2030, 3, 12)})
    cycle: dict = {"message": "a cycle"}
    cycle["again"] = cycle
    with pytest.raises(HotelError, match="nested more than"):  # it never ends
        writer.text(cycle)
    assert writer.stats() == {"written": 0, "refused": 3}


def test_the_concierge_says_the_sentence_for_an_answer_too_deep_to_write():
    """The agent's side: a hotel tool whose answer is nested 100,000 deep becomes the tool's error (the
    sentence the model reads), not a RecursionError in the call."""
    import asyncio

    from livekit.agents.llm import ToolError

    from agent.hotel import RESULTS, Concierge

    class DeepHotel:
        deadline_s = 5.0

        def call(self, name, arguments, *, session, deadline):
            return nested(100_000)

    agent = Concierge.__new__(Concierge)  # the tool runner alone: no prompt, no session
    agent._hotel, agent._session_key, agent._failed_lookups = DeepHotel(), "s", 0
    before = RESULTS.stats()["refused"]
    with pytest.raises(ToolError) as raised:
        asyncio.run(agent._call("hotel_info", {"topic": "parking"}, None))
    assert "could not be read" in str(raised.value)
    assert RESULTS.stats()["refused"] == before + 1


def test_the_engine_takes_a_result_nested_100000_deep_as_text():
    """The engine's side (engine/tick/handle.py): a tool result is any text; one nested too deep to parse
    safely is not parsed for its private words, and reaches the model as the text it is."""
    from engine.tick.handle import _json_object

    deep = "[" * 100_000 + "]" * 100_000
    assert _json_object(deep) == {}
    assert _json_object('{"name": "Hopper", "detail": [[1]]}') == {"name": "Hopper", "detail": [[1]]}
