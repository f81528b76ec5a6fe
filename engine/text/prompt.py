"""The system prompt text the model is prefilled with: the agent's prompt plus the `<AVAILABLE_TOOLS>` block.

Reproduces the chat template the model was trained with (MODEL_SPEC 3; the NemotronH template's tool
branch, also rendered by vllm-omni's duplex adapter): after the system prompt and a blank line, a fixed
sentence, the tools as `<AVAILABLE_TOOLS>[...]</AVAILABLE_TOOLS>` where each tool is its function
definition without a `type` key, serialised as Jinja's `tojson` does (sorted keys, `", "`/`": "`
separators, ASCII, `<>&'` escaped as `\\u003c` etc.) and joined by `", "`, then the fixed instructions
for `<TOOLCALL>` and `<TOOL_RESPONSE>`. No tools: the system prompt alone. Pure functions; knows
nothing of tokenizers, hotels or LiveKit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

MAX_TOOLS = 5

TOOLS_INTRO = "You can use the following tools to assist the user if required:"
TOOLS_OUTRO = (
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool calls if any "
    "errors are found, or just respond to the user."
)


def _tojson(value: Any) -> str:
    """Jinja2's `tojson` filter: json.dumps(sort_keys=True), then HTML-safe escapes."""
    text = json.dumps(value, sort_keys=True)
    return (
        text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
    )


def _definition(tool: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A tool's function definition: {name, description, parameters}, from either the flat form or
    OpenAI's {"type": "function", "function": {...}}."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"tool {index} must be an object, got {type(tool).__name__}")
    function = tool.get("function", tool)
    if not isinstance(function, Mapping):
        raise ValueError(f"tool {index} has no function definition")
    definition = {key: value for key, value in function.items() if key != "type"}
    name = definition.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"tool {index} needs a name")
    parameters = definition.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
    return definition


def render_tool_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool part of the system prompt, from `You can use the following tools` to the end.

    `tools` are OpenAI-style function schemas ({name, description, parameters}, or wrapped as
    {"type": "function", "function": {...}}). Empty -> "". Raises ValueError for more than five
    tools, duplicate names, or a malformed tool.
    """
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"the model accepts at most {MAX_TOOLS} tools, got {len(tools)}")
    if not tools:
        return ""
    definitions = [_definition(tool, i) for i, tool in enumerate(tools)]
    names = [d["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    listed = ", ".join(_tojson(d) for d in definitions)
    return f"{TOOLS_INTRO}\n<AVAILABLE_TOOLS>[{listed}]</AVAILABLE_TOOLS>\n\n{TOOLS_OUTRO}"


def system_prompt_text(system_prompt: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """The whole prompt text before tokenisation: `system_prompt`, a blank line, the tool block."""
    block = render_tool_block(tools)
    if not block:
        return system_prompt
    return f"{system_prompt}\n\n{block}" if system_prompt else block
