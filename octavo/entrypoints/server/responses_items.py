"""/v1/responses' items and fields in chat's terms: input items -> chat messages, a stored
response's output -> the chat messages of its turn, function tools, tool_choice, `text.format`
and `reasoning` -> their chat fields; and the output items' shapes (reasoning, message,
function_call) as OpenAI writes them.

Every refusal is a 400 naming the Responses field (`input`, `tools`, `tool_choice`, `text`,
`reasoning`) and, for an item, which one.

Must not: know about HTTP, the engine or the store (serving_responses.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from octavo.entrypoints.server.chat_render import with_reasoning_effort
from octavo.entrypoints.server.errors import bad_request
from octavo.entrypoints.server.protocol_responses import ResponsesRequest

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


# --- input items -> chat messages -------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content: only text parts (input_text, output_text) are supported, "
                f"got {kind or type(part).__name__!r}.",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _add_assistant(messages: list[dict[str, Any]], key: str, value: Any) -> None:
    """Thinking, text and calls of one assistant turn come as separate items: they go into
    one assistant message while it has none of that kind yet (calls always join)."""
    last = _last_assistant(messages)
    if key == "tool_calls":
        if last is not None:
            last.setdefault("tool_calls", []).append(value)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [value]})
        return
    if last is not None and last.get(key) is None:
        last[key] = value
        return
    messages.append({"role": "assistant", "content": None, key: value})


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """`input` -> chat messages; 400 naming `input` for an item octavo does not take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise bad_request(f"{where} must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(_INPUT_ROLES)}; got {role!r}.",
                    "input",
                )
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                _add_assistant(messages, "content", text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call needs name and call_id.", "input")
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise bad_request(f"{where}.arguments must be a JSON string.", "input")
            call = {"id": item["call_id"], "type": "function"}
            _add_assistant(
                messages,
                "tool_calls",
                {**call, "function": {"name": item["name"], "arguments": arguments}},
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs call_id.", "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if item.get("encrypted_content"):
                raise bad_request(f"{where}: encrypted reasoning is not supported.", "input")
            if not isinstance(parts, list) or not all(
                isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in parts
            ):
                raise bad_request(f"{where}: reasoning content must be text parts.", "input")
            text = "".join(p["text"] for p in parts)
            _add_assistant(messages, "reasoning", text)
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r}.", "input")
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of its assistant turn."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
            _add_assistant(messages, "reasoning", text)
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            _add_assistant(messages, "content", text)
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            _add_assistant(messages, "tool_calls", call)
    return messages


# --- tools, formats -------------------------------------------------------------------------


def chat_tools(tools: list[Any]) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: type, name, description, parameters, strict) -> chat
    tools; any other tool type (web search, file search, MCP, ...) is a 400 naming `tools`."""
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise bad_request(
                f"tools[{index}]: only function tools are supported, got type {kind!r}.", "tools"
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        converted.append({"type": "function", "function": function})
    return converted or None


def chat_tool_choice(tool_choice: Any, has_tools: bool) -> Any:
    """vLLM's rules: "auto" (the default) and "none" without tools are "none"; "required"
    or a named function needs tools."""
    if tool_choice in ("auto", "none", "required"):
        if not has_tools:
            if tool_choice == "required":
                raise bad_request(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                    "tool_choice",
                )
            return "none"
        return tool_choice
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = tool_choice.get("name")
        if not isinstance(name, str) or not name or not has_tools:
            raise bad_request(
                "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}; '
        f"got {tool_choice!r}.",
        "tool_choice",
    )


def chat_response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text = request.text
    if text is None:
        return None
    if text.verbosity is not None:
        raise bad_request("text.verbosity is not supported by octavo.", "text")
    form = text.format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.schema_ is None:
        raise bad_request("text.format.schema is required when type is 'json_schema'.", "text")
    if request.structured_outputs is not None:
        raise bad_request(
            "Cannot specify both structured_outputs and text.format", "structured_outputs"
        )
    schema = {"name": form.name, "schema": form.schema_, "strict": form.strict}
    return {"type": "json_schema", "json_schema": schema}


def template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, plus `reasoning.effort` as vLLM passes it (reasoning_effort,
    and enable_thinking unless the request sets it)."""
    kwargs = dict(request.chat_template_kwargs or {})
    reasoning = request.reasoning
    if reasoning is not None:
        if reasoning.summary is not None or reasoning.generate_summary is not None:
            raise bad_request("reasoning.summary is not supported by octavo.", "reasoning")
        kwargs = with_reasoning_effort(kwargs, reasoning.effort)
    return kwargs or None


# --- output items ---------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if text else [],
    }


def reasoning_item(item_id: str, text: str, status: str | None) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
