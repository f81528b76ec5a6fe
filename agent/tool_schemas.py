"""An agent's function tools in the form the engine takes them: {name, description, parameters} each, which
the engine renders into its prompt's tool block.

Runs where a duplex session opens its engine slot (agent/duplex.py), and where the hotel agent's tools are
listed (agent/hotel.py: the worker's warm prompts among them). Knows livekit-agents' tool types; nothing of
the engine, its tokens or rooms.
"""

from __future__ import annotations

from typing import Any

from livekit.agents import llm


def tool_schemas(tools: list[llm.Tool]) -> list[dict[str, Any]]:
    """Function tools as {name, description, parameters}, the form the engine renders into its prompt."""
    found = []
    for tool in llm.ToolContext(tools).flatten():
        if isinstance(tool, llm.RawFunctionTool):
            schema = tool.info.raw_schema
        elif isinstance(tool, llm.FunctionTool):
            schema = llm.utils.build_legacy_openai_schema(tool, internally_tagged=True)
        else:
            raise TypeError(f"the duplex model takes function tools only, not {type(tool).__name__}")
        params = schema.get("parameters") or {"type": "object", "properties": {}}
        found.append(
            {"name": schema["name"], "description": schema.get("description") or "", "parameters": params}
        )
    return found
