"""The Qwen3-Coder XML tool-call format (`--tool-call-parser qwen3_coder`, also `qwen3_xml`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Owns that reading. Content is the text before the first `<tool_call>` (or `<function=`, when
the model leaves the wrapper out). A parameter's value is its text with one newline taken off
each end, converted by the type the request's tool schema gives it, with vLLM's rules:
strings stay text; integers, numbers, booleans, objects and arrays are parsed (a value that
does not parse stays text); `null` is null whatever the type; a parameter the schema does not
know stays text. The arguments are the JSON object of the parameters in order, written as
`json.dumps` writes it; while streaming, a parameter goes out once it is closed (its value's
type may need all of it) and the closing brace once the function is.

Must not: depend on the tokenizer (tags are matched in text).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from typing import Any

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.section import (
    PartialCall,
    SectionToolParser,
    held_back,
)

logger = logging.getLogger(__name__)

TOOL_CALL = "<tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
_FUNCTION = re.compile(r"<function=(.*?)(</function>|\Z)", re.DOTALL)
# A parameter ends at its closing tag, or where the next parameter or the function's end begins.
_PARAMETER = re.compile(
    r"<parameter=(.*?)(</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


@register_tool_parser("qwen3_xml")
@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(SectionToolParser):
    def split(self, text: str) -> tuple[int, bool]:
        starts = [index for index in (text.find(TOOL_CALL), text.find(FUNCTION)) if index != -1]
        if starts:
            return min(starts), True
        held = max(held_back(text, TOOL_CALL), held_back(text, FUNCTION))
        return len(text) - held, False

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        calls = []
        for function in _FUNCTION.finditer(section):
            closed = bool(function.group(2)) or final
            body = function.group(1)
            name_end = body.find(">")
            if name_end == -1:
                if final:
                    return None
                break
            name = body[:name_end].strip()
            if not name:
                return None
            pieces = []
            for parameter in _PARAMETER.finditer(body, name_end + 1):
                if not (parameter.group(2) or parameter.end() < len(body) or closed):
                    break  # still being written
                piece = self._read_parameter(name, parameter.group(1))
                if piece is None:
                    if closed:
                        return None
                    break
                pieces.append(piece)
            arguments = "{" + ", ".join(pieces) + ("}" if closed else "")
            calls.append(PartialCall(name, arguments))
            if not closed:
                break
        return calls

    def _read_parameter(self, function: str, text: str) -> str | None:
        """`key>value` -> `"key": <JSON value>`, or None while the key is unfinished."""
        key_end = text.find(">")
        if key_end == -1:
            return None
        key = text[:key_end].strip()
        value = text[key_end + 1 :]
        value = value.removeprefix("\n").removesuffix("\n")
        converted = convert_value(value, self._parameter_type(function, key))
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(converted, ensure_ascii=False)}"

    def _parameter_type(self, function: str, key: str) -> str | None:
        for tool in self.tools:
            spec = tool.get("function", {})
            if spec.get("name") != function:
                continue
            parameters = spec.get("parameters") or {}
            properties = parameters.get("properties", parameters)
            schema = properties.get(key) if isinstance(properties, dict) else None
            if not isinstance(schema, dict):
                return None
            return str(schema.get("type", "string")).strip().lower()
        return None


def convert_value(value: str, param_type: str | None) -> Any:
    """A parameter's text -> its value for `param_type` (None: not in the schema: text)."""
    if value.lower() == "null":
        return None
    if param_type is None or param_type in _STRING_TYPES:
        return value
    if param_type.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if param_type.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if param_type in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    if param_type in ("object", "array", "arr") or param_type.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        literal = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return value
    try:
        json.dumps(literal)
    except (TypeError, ValueError):
        return value
    return literal
