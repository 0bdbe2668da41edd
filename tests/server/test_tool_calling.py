"""Tool calling on /v1/chat/completions: request checks (400s naming `tools` or `tool_choice`),
tool_choice resolved into a parser and an output constraint, the stream glue (OpenAI's delta
shapes, finish_reason "tool_calls") on scripted outputs, and end-to-end calls on the embedded
model.

The forced-call tests (`test_forced_*`) rely on structured-output enforcement in the engine:
without it the unconstrained model answers in prose and they fail by design.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from octavo.core.sampling_params import StructuredOutputsParams
from octavo.engine.outputs import CompletionOutput
from octavo.entrypoints.server.app import ServerConfig, build_app
from octavo.entrypoints.server.errors import OpenAIError
from octavo.entrypoints.server.protocol import ChatCompletionRequest
from octavo.entrypoints.server.serving_chat import _Choice, _final_message, _stream_delta
from octavo.entrypoints.server.tool_parsers import (
    HermesToolParser,
    NamedToolParser,
    RequiredToolsParser,
)
from octavo.entrypoints.server.tool_parsers.tool_choice import (
    ToolServing,
    required_schema,
    resolve_tools,
)
from octavo.metrics.prometheus import PrometheusStatLogger

from .utils import assert_error

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": TIME_SCHEMA,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **fields}


def sse_events(text: str) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassemble(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]], str | None]:
    """A stream as an OpenAI client folds it: content, calls by index, the finish reason."""
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = piece.get("id", call["id"])
                function = piece.get("function", {})
                call["name"] = function.get("name", call["name"])
                call["arguments"] += function.get("arguments", "")
            finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


# --- 400s -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,param,fragment",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "tool_choice names function 'nope', which is not in tools ('get_weather', 'get_time')",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "strin"}},
                            },
                        },
                    }
                ],
                "tool_choice": "none",
            },
            "tools",
            "tools[0].function.parameters is not a valid JSON schema: at $.properties.a.type",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "none",
            },
            "tools",
            "must describe an object",
        ),
        (
            {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"},
            "tools",
            "tools[1].function.name 'get_weather' is used by two tools",
        ),
        ({}, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs a non-empty tools list"),
        ({"tool_choice": "sometimes"}, "tool_choice", "Invalid value for 'tool_choice'"),
        ({"tools": [{"type": "function"}]}, "tools", "Invalid value for 'tools'"),
    ],
)
def test_bad_tools_and_tool_choice_are_400s_naming_them(
    http, server, fields, param, fragment
) -> None:
    assert_error(http.post(CHAT, json=chat_body(**fields)), param, fragment)
    server.assert_no_leak()


def test_tool_call_arguments_in_history_must_be_json(http) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{city: Paris"},
                }
            ],
        },
    ]
    response = http.post(CHAT, json=chat_body(messages=messages, tool_choice="none"))
    assert_error(response, "messages", "messages[1].tool_calls[0].function.arguments is not")


# --- tool_choice -> parser and constraint ---------------------------------------------------


def _setup(tool_choice: Any, serving: ToolServing | None = None):
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
    )
    return resolve_tools(request.tools, request.tool_choice, serving or ToolServing())


def test_tool_choice_resolves_to_parser_and_constraint() -> None:
    none = _setup("none")
    assert (none.tools, none.make_parser, none.structured_outputs) == (TOOLS, None, None)
    named = _setup({"type": "function", "function": {"name": "get_time"}})
    assert named.structured_outputs == StructuredOutputsParams(json=TIME_SCHEMA)
    parser = named.make_parser()
    assert isinstance(parser, NamedToolParser) and parser.name == "get_time"
    required = _setup("required")
    assert required.structured_outputs == StructuredOutputsParams(
        json=required_schema([WEATHER_SCHEMA, TIME_SCHEMA], ["get_weather", "get_time"])
    )
    assert isinstance(required.make_parser(), RequiredToolsParser)
    auto = _setup("auto", ToolServing("hermes", enable_auto_tool_choice=True))
    assert isinstance(auto.make_parser(), HermesToolParser)
    assert (auto.structured_outputs, auto.keeps_special_tokens) == (None, False)
    mistral = _setup("auto", ToolServing("mistral", enable_auto_tool_choice=True))
    assert mistral.keeps_special_tokens and mistral.make_parser().tools == TOOLS
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        _setup("auto", ToolServing("hermes"))


def test_required_schema_accepts_calls_and_rejects_anything_else() -> None:
    schema = required_schema([WEATHER_SCHEMA, None], ["get_weather", "now"])
    validator = jsonschema.Draft202012Validator(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
        {"name": "now", "parameters": {}},
    ]
    assert validator.is_valid(good)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "now"}],
    ):
        assert not validator.is_valid(bad), bad


def test_required_schema_moves_definitions_to_the_root() -> None:
    with_defs = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}},
    }
    schema = required_schema([with_defs], ["f"])
    assert schema["$defs"] == {"P": {"type": "integer"}}
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "f", "parameters": {"p": 3}}])
    assert not validator.is_valid([{"name": "f", "parameters": {"p": "x"}}])
    clash = {"type": "object", "$defs": {"P": {"type": "string"}}}
    with pytest.raises(OpenAIError, match=r"two tools define \$defs/P differently"):
        required_schema([with_defs, clash], ["f", "g"])


def test_tool_serving_flags_are_checked_at_start_up() -> None:
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*; got 'xml'"):
        ServerConfig(tool_call_parser="xml")


# --- stream glue on scripted outputs --------------------------------------------------------


def _outputs(pieces: list[str], finish_reason: str) -> list[CompletionOutput]:
    return [
        CompletionOutput(0, piece, [1], None, None, finish_reason if i == len(pieces) - 1 else None)
        for i, piece in enumerate(pieces)
    ]


def test_stream_deltas_have_openai_shapes_and_finish_with_tool_calls() -> None:
    text = (
        'I will check. <tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}'
        "\n</tool_call>"
    )
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    choice = _Choice(parser=HermesToolParser())
    deltas = [_stream_delta(choice, output) for output in _outputs(pieces, "stop")]
    shown = [d.model_dump() for d in deltas if d is not None]
    assert all("<" not in d.get("content", "") for d in shown)
    calls = [d["tool_calls"][0] for d in shown if "tool_calls" in d]
    assert set(calls[0]) == {"index", "id", "type", "function"}
    assert (calls[0]["index"], calls[0]["type"], calls[0]["function"]["name"]) == (
        0,
        "function",
        "get_time",
    )
    assert all(
        set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:]
    )
    assert "".join(d.get("content", "") for d in shown) == "I will check."
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"timezone": "CET"}'
    assert choice.called
    whole = _Choice(parser=HermesToolParser(), text=[text], finish_reason="stop")
    message, finish_reason = _final_message(whole)
    assert finish_reason == "tool_calls"
    assert message.model_dump()["content"] == "I will check."
    assert message.tool_calls[0].function.arguments == '{"timezone": "CET"}'


def test_a_call_cut_by_max_tokens_keeps_finish_reason_length() -> None:
    choice = _Choice(
        parser=HermesToolParser(),
        text=['<tool_call>{"name": "get_time", "arguments": {"timez'],
        finish_reason="length",
    )
    message, finish_reason = _final_message(choice)
    assert finish_reason == "length"
    assert message.tool_calls is None
    assert message.content == '<tool_call>{"name": "get_time", "arguments": {"timez'


# --- end to end on the embedded model --------------------------------------------------------


def test_tool_choice_none_renders_and_answers_in_prose(http, server) -> None:
    response = http.post(CHAT, json=chat_body(tool_choice="none", max_tokens=8))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    server.assert_no_leak()


@pytest.fixture(scope="module")
def auto_client(server):
    """A second app over the same engine, with --tool-call-parser hermes and
    --enable-auto-tool-choice, called in-process on the engine's event loop."""
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    app = build_app(server.async_engine, config, PrometheusStatLogger("auto"))

    def post(body: dict[str, Any]) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://auto") as client:
                return await client.post(CHAT, json=body, timeout=120)

        loop = server.async_engine.loop
        return asyncio.run_coroutine_threadsafe(send(), loop).result(180)

    return post


def test_auto_tool_choice_stream_and_whole_answer_agree(auto_client, server) -> None:
    whole = auto_client(chat_body(max_tokens=24))
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    streamed = auto_client(chat_body(max_tokens=24, stream=True))
    content, calls, finish = reassemble(sse_events(streamed.text))
    message = choice["message"]
    assert content == (message["content"] or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert finish == choice["finish_reason"]
    server.assert_no_leak()


def _forced_call(http, tool_choice: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    response = http.post(CHAT, json=chat_body(tool_choice=tool_choice))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert ID.fullmatch(call["id"]) and call["type"] == "function"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )
    return choice, calls


def test_forced_named_call_is_valid_and_streams_the_same(http, server) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    _, calls = _forced_call(http, tool_choice)
    assert [call["function"]["name"] for call in calls] == ["get_weather"]
    streamed = http.post(CHAT, json=chat_body(tool_choice=tool_choice, stream=True))
    content, stream_calls, finish = reassemble(sse_events(streamed.text))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in stream_calls] == [
        ("get_weather", calls[0]["function"]["arguments"])
    ]
    assert ID.fullmatch(stream_calls[0]["id"])
    server.assert_no_leak()


def test_forced_required_calls_through_the_openai_client(http, server) -> None:
    """The official client parses the streamed deltas into its typed tool calls."""
    _, calls = _forced_call(http, "required")
    assert len(calls) >= 1
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, timeout=120)
    body = chat_body(tool_choice="required")
    del body["max_tokens"], body["temperature"]
    stream_calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=80, temperature=0, stream=True, **body
    ):
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            call = stream_calls.setdefault(piece.index, [piece.id, piece.function.name, ""])
            call[2] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(name, arguments) for _, name, arguments in stream_calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert all(ID.fullmatch(call_id) for call_id, _, _ in stream_calls.values())
    server.assert_no_leak()
