"""The concierge prompt and the `<AVAILABLE_TOOLS>` block, read the way the model reads them."""

from __future__ import annotations

import json
import re
from datetime import date

import pytest

from engine.text.prompt import MAX_TOOLS, render_tool_block, system_prompt_text
from prompts import load_prompt
from tools import schemas

# The tool branch of the chat template the model was trained with (NemotronH / NeMo speechlm2 function
# calling), verbatim: rendering through Jinja itself is the reference for our pure-Python renderer.
TRAINING_TEMPLATE = (
    "{{- system_message -}}"
    "{%- if tools -%}"
    "{%- if system_message != '' -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can use the following tools to assist the user if required:' -}}"
    "{{- '\\n<AVAILABLE_TOOLS>[' -}}"
    "{%- for tool in tools -%}"
    "{%- set _t = (tool.function if tool.function is defined else tool) -%}"
    "{%- set _d = {} -%}"
    "{%- for k, v in _t.items() if k != 'type' -%}{%- set _ = _d.update({k: v}) -%}{%- endfor -%}"
    "{{- _d | tojson -}}"
    "{{- ', ' if not loop.last else '' -}}"
    "{%- endfor -%}"
    "{{- ']</AVAILABLE_TOOLS>\\n\\n' -}}"
    "{{- 'If you decide to call any tool(s), use the following format:\\n' -}}"
    '{{- \'<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, \' -}}'
    '{{- \'{"name": "tool_name2", "arguments": "tool_args2"}]\' -}}'
    "{{- '</TOOLCALL>\\n\\n' -}}"
    "{{- 'The user will execute tool-calls and return responses from tool(s) in this format:\\n' -}}"
    '{{- \'<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\\n\\n\' -}}'
    "{{- 'Based on the tool responses, you can call additional tools if needed, "
    "correct tool calls if any errors are found, or just respond to the user.' -}}"
    "{%- endif -%}"
)

TRICKY_TOOL = {
    "type": "function",
    "function": {
        "type": "function",
        "name": "say_it",
        "description": "Quotes 'this' & <that>, in café style.",
        "parameters": {
            "type": "object",
            "properties": {
                "z": {"type": "string", "description": "Z"},
                "a": {"type": "integer", "description": "A"},
            },
        },
    },
}


def concierge_prompt() -> str:
    return load_prompt("concierge", hotel_name="The Larkspur Hotel", today="Monday, March 4, 2030")


def read_tools(text: str) -> list[dict]:
    """What the model can recover from its prompt: the JSON list between the tags."""
    (block,) = re.findall(r"<AVAILABLE_TOOLS>(.*?)</AVAILABLE_TOOLS>", text, flags=re.DOTALL)
    return json.loads(block)


@pytest.mark.parametrize("system", ["", "You are a concierge.", "Line one.\nLine two with 'quotes'."])
@pytest.mark.parametrize("tools", [[], [TRICKY_TOOL], schemas.tool_specs()], ids=["none", "tricky", "hotel"])
def test_rendering_equals_the_training_template(system, tools):
    jinja2 = pytest.importorskip("jinja2")
    expected = jinja2.Environment().from_string(TRAINING_TEMPLATE).render(system_message=system, tools=tools)
    assert system_prompt_text(system, tools) == expected


def test_the_rendered_prompt_as_the_model_reads_it():
    text = system_prompt_text(concierge_prompt(), schemas.tool_specs())
    assert text.isascii(), "the model was trained on ASCII prompts"
    assert text.startswith(
        "You are the phone concierge of The Larkspur Hotel. Today is Monday, March 4, 2030."
    )
    assert "{{" not in text and "<!--" not in text
    tools = read_tools(text)
    assert 1 <= len(tools) <= MAX_TOOLS
    assert sorted(t["name"] for t in tools) == sorted(schemas.WEB_TOOLS)
    for tool in tools:
        assert set(tool) == {"name", "description", "parameters"}
        assert len(tool["description"]) > 20, tool["name"]
        params = tool["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"]), tool["name"]
        for field, spec in params["properties"].items():
            assert spec.get("description", "").strip(), f"{tool['name']}.{field} has no description"
            assert spec.get("type") in ("string", "integer", "boolean"), f"{tool['name']}.{field}: {spec}"
            assert "anyOf" not in spec and "$ref" not in spec and "title" not in spec
    tail = text.split("</AVAILABLE_TOOLS>", 1)[1]
    assert "<TOOLCALL>[" in tail and "<TOOL_RESPONSE>[" in tail


def test_every_tool_argument_the_schema_allows_is_what_the_validator_accepts():
    # An example call built only from the rendered schema's required fields and enums validates.
    examples = {
        "string": {
            "check_in": "2030-03-12",
            "guest_name": "Ada Lovelace",
            "contact": "+1 555 010 9999",
            "room_type": "deluxe",
            "confirmation_code": "ACDE-FHJK",
            "last_name": "Lovelace",
            "topic": "parking",
        },
        "integer": {"guests": 2, "nights": 2},
    }
    for tool in schemas.tool_specs():
        props = tool["parameters"]["properties"]
        args = {}
        for field in tool["parameters"]["required"]:
            spec = props[field]
            args[field] = spec["enum"][0] if "enum" in spec else examples[spec["type"]][field]
        schemas.parse_args(
            tool["name"], args
        )  # raises if the schema promised something the validator refuses
        assert set(schemas.TOOLS[tool["name"]].model_fields) == set(props)


def test_the_concierge_prompt_sets_the_spoken_rules():
    text = concierge_prompt()
    sentences_rule = re.search(r"at most (\w+) short sentences", text)
    assert sentences_rule and sentences_rule.group(1) == "three"
    for rule in (
        "one missing detail at a time",
        "Read back names, dates",
        "corrects something",
        "never guess",
    ):
        assert rule in text, rule
    assert len(text) < 3000  # prefilled for every call


def test_too_many_tools_are_refused():
    tools = [
        {"name": f"t{i}", "description": "d", "parameters": {"type": "object", "properties": {}}}
        for i in range(6)
    ]
    assert [t["name"] for t in read_tools(render_tool_block(tools[:5]))] == ["t0", "t1", "t2", "t3", "t4"]
    with pytest.raises(ValueError, match="at most 5"):
        render_tool_block(tools)
    with pytest.raises(ValueError, match="at most 5"):
        system_prompt_text("x", tools)


@pytest.mark.parametrize(
    "tools",
    [
        [{"description": "no name"}],
        [{"name": ""}],
        ["book_room"],
        [{"type": "function", "function": "book_room"}],
        [{"name": "a"}, {"name": "a"}],
        [{"name": "a", "parameters": ["not", "a", "schema"]}],
    ],
)
def test_malformed_tools_are_refused(tools):
    with pytest.raises(ValueError):
        render_tool_block(tools)


def test_no_tools_leaves_the_prompt_alone():
    assert render_tool_block([]) == ""
    assert system_prompt_text("Hello.", []) == "Hello."


def test_load_prompt_fills_fields_and_refuses_mistakes():
    assert load_prompt("concierge", hotel_name="H", today=date(2030, 3, 4).isoformat()).startswith(
        "You are the phone concierge of H. Today is 2030-03-04."
    )
    with pytest.raises(KeyError, match="needs"):
        load_prompt("concierge", hotel_name="H")
    with pytest.raises(KeyError, match="no field"):
        load_prompt("concierge", hotel_name="H", today="T", mood="cheerful")
    with pytest.raises(FileNotFoundError):
        load_prompt("no_such_prompt")
    with pytest.raises(ValueError):
        load_prompt("../pyproject")
