"""`parse_tool_call` on whatever the function channel may produce: random text, random token ids decoded by
the real tokenizer (invalid UTF-8 included), random JSON, deep nesting, huge numbers. It returns calls with a
name and a dict of arguments, or raises `ToolCallError`; nothing else ever leaves it (anything else would be
raised on the tick thread). Deterministic (derandomized), so a failure reproduces."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config.stage_config import TokenConfig
from engine.text.tokens import CALL_CLOSE, CALL_OPEN, ParsedCall, Tokens, ToolCallError, parse_tool_call

TOK = Tokens(TokenConfig())
FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def check(text: str) -> None:
    try:
        calls = parse_tool_call(text)
    except ToolCallError as e:
        assert str(e)  # a reason the model is told
        return
    assert calls and all(isinstance(c, ParsedCall) for c in calls)
    assert all(isinstance(c.name, str) and c.name and isinstance(c.arguments, dict) for c in calls)


def wrapped(body: str) -> str:
    return CALL_OPEN + body + CALL_CLOSE


@FUZZ
@given(st.text())
def test_any_text(text):
    check(text)
    check(wrapped(text))


@FUZZ
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=80))
def test_any_token_ids_as_the_tokenizer_decodes_them(ids):
    text = TOK.decode(ids)  # byte-level pieces that do not form UTF-8 decode to replacement characters
    check(text)
    check(wrapped(text))
    check(wrapped('[{"name": "hotel_info", "arguments": ' + text + "}]"))


@FUZZ
@given(st.binary(max_size=200))
def test_invalid_utf8_once_decoded(raw):
    for errors in ("replace", "surrogateescape", "ignore"):
        check(wrapped(raw.decode("utf-8", errors=errors)))


@FUZZ
@given(json_values, json_values)
def test_any_json_in_the_call_shape(name, arguments):
    check(wrapped(json.dumps(name)))
    check(wrapped(json.dumps([{"name": name, "arguments": arguments}])))
    check(wrapped(json.dumps([{"name": "book_room", "arguments": json.dumps(arguments)}])))


@FUZZ
@given(st.integers(1, 200_000), st.sampled_from(["[", '{"a": ', '[{"name": "x", "arguments": ']))
def test_deep_nesting(depth, opener):
    closer = {"[": "]", '{"a": ': "}", '[{"name": "x", "arguments": ': "}]"}[opener]
    check(wrapped(opener * depth + "1" + closer * depth))
    check(wrapped(opener * depth))  # never closed


@FUZZ
@given(st.integers(1, 100_000))
def test_huge_numbers(digits):
    number = "9" * digits
    check(wrapped(f'[{{"name": "book_room", "arguments": {{"guests": {number}}}}}]'))
    check(wrapped(f'[{{"name": "book_room", "arguments": {{"guests": {number}e{number}}}}}]'))
    check(wrapped(f'[{{"name": "book_room", "arguments": "{{\\"guests\\": {number}}}"}}]'))


def test_the_known_bad_cases_are_the_parsers_own_errors():
    for text in (
        wrapped("[" * 5000 + "]" * 5000),
        wrapped('[{"name": "a", "arguments": {"n": ' + "9" * 5000 + "}}]"),
        wrapped('[{"name": "a", "arguments": "' + "[" * 5000 + '"}]'),
        wrapped("\udcff"),
    ):
        try:
            parse_tool_call(text)
        except ToolCallError:
            continue
        raise AssertionError(f"accepted: {text[:60]!r}")
    good = parse_tool_call(wrapped('[{"name": "hotel_info", "arguments": {"topic": "parking"}}]'))
    assert good == [ParsedCall("hotel_info", {"topic": "parking"})]
