"""The request side of tool calling: `tools` checked, `tool_choice` resolved.

Owns `ToolSetup`, what a chat request's tools mean for each stage: the tool list the chat
template renders, the parser that reads each choice, and the structured-output constraint
that forces a call. The rules are vLLM's:
- `tool_choice` defaults to "auto" when tools are given, else "none";
- "none" still renders the tools (unless the server excludes them,
  --exclude-tools-when-tool-choice-none), and the output is plain content;
- "auto" needs the server's `--enable-auto-tool-choice` and `--tool-call-parser`;
- a named function constrains the output to its parameters' JSON schema (the output is then
  the arguments object); "required" to a non-empty array of `{"name", "parameters"}` items,
  one `anyOf` branch per tool.
Every refusal is a 400 naming `tools` or `tool_choice`.

Must not: parse model output (the parsers do) or touch the engine.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from octavo.core.sampling_params import StructuredOutputsParams
from octavo.entrypoints.server.errors import bad_request
from octavo.entrypoints.server.protocol import ChatCompletionToolsParam, ToolChoice
from octavo.entrypoints.server.tool_parsers.base import ToolParser, get_tool_parser
from octavo.entrypoints.server.tool_parsers.forced import NamedToolParser, RequiredToolsParser

# What a function without `parameters` takes: nothing.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")


@dataclass(frozen=True)
class ToolServing:
    """The server-wide tool settings (vLLM's flags)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # tool_choice "none" leaves the tools out of the prompt (else the template renders them).
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming tool_call_parser
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice (--enable-auto-tool-choice) needs "
                "tool_call_parser (--tool-call-parser)."
            )


@dataclass(frozen=True)
class ToolSetup:
    # The tools as the chat template takes them ({"type": "function", "function": {...}}).
    tools: list[dict[str, Any]] | None = None
    # Makes one parser per choice; None: the output is plain content.
    make_parser: Callable[[], ToolParser] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The parser's markers are special tokens: the output must be decoded with them.
    keeps_special_tokens: bool = False


def check_tools(tools: list[ChatCompletionToolsParam] | None) -> list[dict[str, Any]] | None:
    """Tools -> the template's dicts. 400 naming `tools` for an empty or duplicate name, or
    parameters that are not a JSON schema (Draft 2020-12) of an object."""
    if tools is None:
        return None
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        function = tool.function
        where = f"tools[{index}].function"
        if not function.name:
            raise bad_request(f"{where}.name must not be empty.", "tools")
        if function.name in seen:
            raise bad_request(f"{where}.name {function.name!r} is used by two tools.", "tools")
        seen.add(function.name)
        if function.parameters is not None:
            _check_schema(function.parameters, f"{where}.parameters")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _check_schema(schema: dict[str, Any], where: str) -> None:
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(
            f"{where} is not a valid JSON schema: at {exc.json_path}: {exc.message}.", "tools"
        ) from None
    if schema.get("type", "object") != "object":
        raise bad_request(
            f"{where} must describe an object (the arguments), got type {schema['type']!r}.",
            "tools",
        )


def resolve_tools(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: ToolChoice | None,
    serving: ToolServing,
) -> ToolSetup:
    checked = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if tool_choice != "none" and not checked:
        raise bad_request("tool_choice needs a non-empty tools list.", "tool_choice")
    if tool_choice == "none":
        return ToolSetup(None if serving.exclude_tools_when_tool_choice_none else checked)
    assert checked is not None and tools is not None
    if tool_choice == "auto":
        if not (serving.enable_auto_tool_choice and serving.tool_call_parser):
            raise bad_request(
                'tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                "--tool-call-parser.",
                "tool_choice",
            )
        parser = get_tool_parser(serving.tool_call_parser)
        return ToolSetup(
            checked,
            functools.partial(parser, checked),
            keeps_special_tokens=parser.keeps_special_tokens,
        )
    if tool_choice == "required":
        schema = required_schema(
            [tool.function.parameters for tool in tools], [tool.function.name for tool in tools]
        )
        return ToolSetup(checked, RequiredToolsParser, StructuredOutputsParams(json=schema))
    name = tool_choice.function.name
    match = [tool for tool in tools if tool.function.name == name]
    if not match:
        known = ", ".join(repr(tool.function.name) for tool in tools)
        raise bad_request(
            f"tool_choice names function {name!r}, which is not in tools ({known}).",
            "tool_choice",
        )
    schema = match[0].function.parameters or _NO_PARAMETERS
    return ToolSetup(checked, lambda: NamedToolParser(name), StructuredOutputsParams(json=schema))


def required_schema(parameters: list[dict[str, Any] | None], names: list[str]) -> dict[str, Any]:
    """A non-empty array of calls, each `{"name": <one tool>, "parameters": <its schema>}`.
    Definitions (`$defs`) move to the root, where the tools' `#/$defs/...` refs now point."""
    branches = []
    definitions: dict[str, dict[str, Any]] = {}
    for name, schema in zip(names, parameters):
        schema = copy.deepcopy(schema) if schema else dict(_NO_PARAMETERS)
        for key in _DEFS_KEYS:
            for def_name, definition in schema.pop(key, {}).items():
                known = definitions.setdefault(key, {})
                if def_name in known and known[def_name] != definition:
                    raise bad_request(
                        f"tools: two tools define {key}/{def_name} differently; tool_choice "
                        '"required" needs them to agree.',
                        "tools",
                    )
                known[def_name] = definition
        branches.append(
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    result: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    result.update(definitions)
    return result
