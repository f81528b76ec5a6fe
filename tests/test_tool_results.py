"""What the model reads back after a tool call, at the tiny preset with dummy weights: a result with lone
surrogates (text no encoder takes) is cleaned and kept, a result that still cannot be encoded is counted as a
failed call, and a tool name with an invisible character in it is answered by naming the character. Calls are
teacher-forced and ticks driven by hand on a clock that moves only when told (engine_support.ManualClock)."""

from __future__ import annotations

import concurrent.futures

import pytest

from engine.api import FunctionCall
from engine.tick.engine import Engine, EngineConfig
from engine_support import CALL, ManualClock, drain, poll_between_ticks, run_ticks
from testkit.concierge import PROMPT, TOOLS


@pytest.fixture
def engine():
    e = Engine(EngineConfig(preset="tiny", num_slots=1, start=False), clock=ManualClock())
    yield e
    e.close()


def waiting_call(engine: Engine):
    """A session whose forced call went out to the agent: (handle, the FunctionCall, the next tick)."""
    h = engine.open_session(PROMPT, TOOLS)
    k = run_ticks(engine, 0, 1)
    h.force_function(engine.tokens.call_ids(CALL))
    k = run_ticks(engine, k, 3)
    return h, next(i for i in drain(h) if isinstance(i, FunctionCall)), k


def prefilled_text(engine: Engine, h) -> str:
    """The text of the result prefill `h` is given, once the encoding pool has made it."""
    poll_between_ticks(engine)  # the result's tokens are encoded off the tick thread
    assert h.phase == "waiting" and h._s.call.response is not None
    concurrent.futures.wait([h._s.call.response], timeout=30)
    poll_between_ticks(engine)
    assert h.phase == "prefill"
    return engine.tokens.decode(h._s.progress.prefill_ids)


def tool_errors(engine: Engine, h) -> int:
    return {s.id: s for s in engine.snapshot().sessions}[h.id].tool_errors


def test_a_two_megabyte_result_with_lone_surrogates_is_cleaned_cut_and_kept(engine):
    h, call, k = waiting_call(engine)
    result = ("Zimmer \ud83d frei \ude00 " * 200_000)[:2_000_000]  # halves of 😀, each alone
    h.submit_tool_result(call.call_id, result)
    text = prefilled_text(engine, h)
    cap = engine.config.max_result_chars
    assert "could not be read" not in text
    assert "Zimmer \ufffd frei \ufffd Zimmer" in text  # each lone half replaced, the words kept
    assert f"the result was cut: 2000000 characters, the first {cap} kept" in text
    run_ticks(engine, k, 4)
    assert h.phase == "live" and tool_errors(engine, h) == 0


def test_a_result_that_cannot_be_encoded_is_counted_as_an_error(engine, monkeypatch):
    h, call, k = waiting_call(engine)
    encode = engine.tokens.response_ids

    def refusing(results: list[dict]) -> list[int]:
        if any("output" in r for r in results):
            raise ValueError("no encoding for this")
        return encode(results)

    monkeypatch.setattr(engine.tokens, "response_ids", refusing)
    h.submit_tool_result(call.call_id, '{"available": true}')
    assert "the tool results could not be read" in prefilled_text(engine, h)
    run_ticks(engine, k, 4)
    assert h.phase == "live" and tool_errors(engine, h) == 1


@pytest.mark.parametrize(
    ("name", "hidden"), [("check_availability\x00", "U+0000"), ("check\u200b", "U+200B")]
)
def test_a_tool_name_with_an_invisible_character_is_answered_by_naming_it(engine, monkeypatch, name, hidden):
    heard: list[str] = []
    encode = engine.tokens.response_ids

    def spy(results: list[dict]) -> list[int]:
        ids = encode(results)
        heard.append(engine.tokens.decode(ids))
        return ids

    monkeypatch.setattr(engine.tokens, "response_ids", spy)
    h = engine.open_session(PROMPT, TOOLS)
    k = run_ticks(engine, 0, 1)
    h.force_function(engine.tokens.call_ids([{"name": name, "arguments": {}}]))
    run_ticks(engine, k, 6)
    assert h.phase == "live" and tool_errors(engine, h) == 1
    (text,) = heard
    assert f"contains an invisible character, {hidden}" in text
    assert "there is no tool named" not in text
