"""Stored text never becomes a control token: a resumed call's prompt (agent/fleet/carry.py's turns, tools'
names, arguments and results, through the database's row) and the function channel's tool calls and results
hold none of the tokenizer's added tokens for any of their strings, whatever text a caller, a tool or the
agent put there; the template's own markers keep theirs, at their own places."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer

from agent.fleet.carry import MAX_TOOLS, Conversation, resume_context
from engine.config.stage_config import TokenConfig
from engine.text.tokens import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, Tokens

SYSTEM = "You are the concierge of a hotel."
TOOLS = [
    {
        "name": "book_room",
        "description": "Book a room",
        "parameters": {"type": "object", "properties": {"guest_name": {"type": "string"}}},
    }
]
# the markers of the model's text formats and others a release's tokenizer may hold as added tokens (some
# not marked special), beside many more numbered ones than the tiny tokenizer's
NAMED = ["<TOOLCALL>", "</TOOLCALL>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>", "<AVAILABLE_TOOLS>"]
NAMED += ["</AVAILABLE_TOOLS>", "<think>", "</think>", "[INST]", "[/INST]", "<pad>", "<|im_end|>"]
NOT_SPECIAL = ["<SRT>", "<extra_0>", "   ", "\u2603"]  # one of a single character (☃)


def tiny() -> Tokens:
    return Tokens(TokenConfig())


def wider(tmp_path) -> Tokens:
    tok = Tokenizer.from_file(TokenConfig().tokenizer)
    tok.add_special_tokens([f"<SPECIAL_{i}>" for i in range(32, 1000)] + NAMED)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    path = tmp_path / "wider.json"
    tok.save(str(path))
    return Tokens(TokenConfig(tokenizer=str(path)))


@pytest.fixture(params=["tiny", "wider"])
def tokens(request, tmp_path) -> Tokens:
    return tiny() if request.param == "tiny" else wider(tmp_path)


def added(tokens: Tokens) -> dict[int, str]:
    return {i: t.content for i, t in tokens.tok.get_added_tokens_decoder().items()}


def chunks(strings: list[str], n: int) -> list[list[str]]:
    return [strings[i : i + n] for i in range(0, len(strings), n)]


def test_every_added_tokens_string_in_every_stored_field_is_text_in_the_resumed_prompt(tokens):
    """Each added token's string (`</s>`, `<SPECIAL_20>`, `<TOOLCALL>`...) in a turn, a tool's name, its
    arguments (a refused call's, as the agent recorded it) and its result, read back from the row: the
    prompt's template part is the one a call without them has, its end the template's `</s>`, and the
    context between them the stored text itself, with no added token's id."""
    strings = sorted(added(tokens).values())
    assert len(strings) >= 32
    base, base_len = tokens.prompt_parts(SYSTEM, TOOLS)
    template = base[:base_len]
    ids_of = set(added(tokens))
    for chunk in chunks(strings, MAX_TOOLS):
        row = Conversation(
            "AJ_special",
            said=[f"I heard {s} from you" for s in chunk],
            tools=[
                {
                    "name": f"find{s}",
                    "arguments": json.dumps({"guest_name": f"a{s}b"}, ensure_ascii=False),
                    "output": json.dumps({"error": f"no guest {s}"}, ensure_ascii=False),
                    "is_error": True,
                }
                for s in chunk
            ],
        ).to_json()
        context = resume_context(Conversation.from_json(row))
        assert all(context.count(s) >= 4 for s in chunk if s.strip())  # each field carried it
        ids, prefix = tokens.prompt_parts(SYSTEM, TOOLS, context)
        assert (ids[:prefix], ids[-1]) == (template, tokens.eos)
        own = ids[prefix:-1]
        assert [(i, added(tokens)[i]) for i in own if i in ids_of] == []
        assert tokens.decode(own) == "\n\n" + context


def test_the_templates_own_markers_keep_their_ids(tmp_path):
    """Where the tokenizer holds the tool block's markers as added tokens, the system prompt's template has
    them at their places: only what is stored is read as text."""
    tokens = wider(tmp_path)
    ids, prefix = tokens.prompt_parts(SYSTEM, TOOLS, "- said <TOOLCALL> once")
    marks = {tokens.tok.token_to_id(m) for m in ("<TOOLCALL>", "<TOOL_RESPONSE>", "<AVAILABLE_TOOLS>")}
    assert marks <= set(ids[:prefix])
    assert marks.isdisjoint(ids[prefix:])


def test_a_tool_calls_arguments_and_results_are_text_on_the_function_channel(tokens):
    """The function channel's call (forced) and result (prefilled): added tokens only where the format puts
    its markers (`<TOOLCALL>` and `<TOOL_RESPONSE>` where the tokenizer holds them), the rest the JSON as
    text."""
    strings = sorted(added(tokens).values())
    ids_of = added(tokens)
    results = [{"guest_name": s, "note": f"x{s}y"} for s in strings]
    calls = [{"name": f"book{s}", "arguments": {"guest_name": s}} for s in strings]
    for ids, (open_, close), body, ends in (
        (
            tokens.response_ids(results),
            (RESPONSE_OPEN, RESPONSE_CLOSE),
            json.dumps(results, ensure_ascii=False),
            0,
        ),
        (tokens.call_ids(calls), (CALL_OPEN, CALL_CLOSE), json.dumps(calls), 1),
    ):
        if ends:  # the call's own start and end
            assert (ids[0], ids[-1]) == (tokens.call_start, tokens.call_end)
            ids = ids[1:-1]
        marks = [i for i in ids if i in ids_of]
        expected = [tokens.tok.token_to_id(m) for m in (open_, close) if m in ids_of.values()]
        assert marks == expected
        assert tokens.decode(ids) == open_ + body + close
        if expected:
            assert (ids[0], ids[-1]) == tuple(expected)


def test_text_without_added_tokens_encodes_as_before(tokens):
    """Stored text that holds no added token gives the ids the tokenizer always gave it."""
    context = "- Your room is booked, Ms Hopper.\n- book_room({}) returned [ok]"
    ids, prefix = tokens.prompt_parts(SYSTEM, TOOLS, context)
    assert ids[prefix:-1] == tokens.encode("\n\n" + context)
    results = [{"confirmation_code": "K7Q2M9", "total_cents": 41580}]
    plain = RESPONSE_OPEN + json.dumps(results) + RESPONSE_CLOSE
    assert tokens.response_ids(results) == tokens.encode(plain)


def library_plain(tokens: Tokens) -> Tokenizer:
    """The tokenizer as the `tokenizers` library encodes text with none of its added tokens matched: each
    marked special, and special tokens encoded as text."""
    spec = json.loads(tokens.tok.to_str())
    for token in spec["added_tokens"]:
        token["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


def test_stored_text_gives_its_own_characters_and_no_added_token(tokens):
    """`encode_text` on text holding added tokens' strings: ids that are the text's characters and no added
    token's, the ids the tokenizers library gives the same text when it matches none of them."""
    plain = library_plain(tokens)
    ids_of = set(added(tokens))
    for s in sorted(added(tokens).values()):
        for text in (s, f"Grace{s}Hopper", f"\n\n- said {s} {s}\u00e9 {s}x", f"{s}<{s}>", s[:-1] + s + s[-1]):
            ids = tokens.encode_text(text)
            assert (tokens.decode(ids), ids_of.intersection(ids)) == (text, set()), text
            assert ids == plain.encode(text, add_special_tokens=False).ids, text
