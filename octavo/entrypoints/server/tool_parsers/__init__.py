"""Tool calling on /v1/chat/completions: parsers that turn model text into OpenAI tool calls
(base.py: the interface and registry; hermes.py: `<tool_call>` markup; forced.py: outputs
forced by structured outputs) and the request side (tool_choice.py: tools checked, tool_choice
resolved into a parser and an output constraint)."""

from __future__ import annotations

from octavo.entrypoints.server.tool_parsers.base import (
    DeltaUpdate,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    merge_updates,
    tool_parser_names,
)
from octavo.entrypoints.server.tool_parsers.forced import NamedToolParser, RequiredToolsParser
from octavo.entrypoints.server.tool_parsers.hermes import HermesToolParser  # registers "hermes"

__all__ = [
    "DeltaUpdate",
    "ExtractedToolCalls",
    "HermesToolParser",
    "NamedToolParser",
    "ParsedToolCall",
    "RequiredToolsParser",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "merge_updates",
    "tool_parser_names",
]
