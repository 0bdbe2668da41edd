"""Tool calling on /v1/chat/completions: parsers that turn model text into OpenAI tool calls
(base.py: the interface and registry; hermes.py: `<tool_call>` markup; section.py: the
shared reading of formats whose calls end the output, one module per format: llama.py,
mistral.py, pythonic.py, qwen3.py, deepseek.py, granite.py; forced.py: outputs forced by
structured outputs) and the request side (tool_choice.py: tools checked, tool_choice
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

# Importing a format's module registers its names.
from octavo.entrypoints.server.tool_parsers.deepseek import DeepSeekV3ToolParser
from octavo.entrypoints.server.tool_parsers.forced import NamedToolParser, RequiredToolsParser
from octavo.entrypoints.server.tool_parsers.granite import GraniteToolParser
from octavo.entrypoints.server.tool_parsers.hermes import HermesToolParser
from octavo.entrypoints.server.tool_parsers.llama import Llama3JsonToolParser
from octavo.entrypoints.server.tool_parsers.mistral import MistralToolParser
from octavo.entrypoints.server.tool_parsers.pythonic import PythonicToolParser
from octavo.entrypoints.server.tool_parsers.qwen3 import Qwen3CoderToolParser

__all__ = [
    "DeepSeekV3ToolParser",
    "DeltaUpdate",
    "ExtractedToolCalls",
    "GraniteToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "ParsedToolCall",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "RequiredToolsParser",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "merge_updates",
    "tool_parser_names",
]
