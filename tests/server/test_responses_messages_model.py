"""/v1/responses and /v1/messages on the embedded model through the `openai` and `anthropic`
clients: greedy text equal to /v1/chat/completions' for the same conversation, and function
calls (forced by tool_choice, so the tiny model calls reliably) with a follow-up turn that
gives the call's result back (function_call_output with previous_response_id; tool_result)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER_SCHEMA,
}
CHAT_TOOL = {
    "type": "function",
    "function": {k: v for k, v in RESPONSES_TOOL.items() if k != "type"},
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": WEATHER_SCHEMA,
}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, auth_token=server.api_key, timeout=120)


def _chat(http, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"messages": messages, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_text_is_chats_on_both_apis(client, claude, http, server) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name three colors."},
    ]
    # A first run puts the prompt in the prefix cache, so that every run below computes it
    # the same way (a hit and a miss may round differently: see test_openai_client).
    chat = _chat(http, messages, max_tokens=12)
    chat = _chat(http, messages, max_tokens=12)
    text = chat["choices"][0]["message"]["content"]
    response = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Name three colors.",
        max_output_tokens=12,
        temperature=0,
    )
    assert response.output_text == text != ""
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="Answer briefly.",
            input="Name three colors.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == text
    message = claude.messages.create(
        model=MODEL,
        system="Answer briefly.",
        messages=messages[1:],
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    assert message.content[0].text == text
    with claude.messages.stream(
        model=MODEL,
        system="Answer briefly.",
        messages=messages[1:],
        max_tokens=12,
        extra_body={"temperature": 0},
    ) as stream:
        assert stream.get_final_message().content[0].text == text
    server.assert_no_leak()


def test_responses_function_call_and_its_output(client, http, server) -> None:
    tool_choice = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[RESPONSES_TOOL],
        tool_choice=tool_choice,
        max_output_tokens=60,
        temperature=0,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    chat_tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    chat = _chat(
        http,
        [{"role": "user", "content": QUESTION}],
        tools=[CHAT_TOOL],
        tool_choice=chat_tool_choice,
        max_tokens=60,
    )
    assert call.arguments == chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]

    # The stream: the call's item, its argument deltas, then done.
    events = list(
        client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=[RESPONSES_TOOL],
            tool_choice=tool_choice,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-2].item.arguments == call.arguments and events[-2].item.name == "get_weather"

    # The follow-up: the call's result, continuing the stored response.
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}],
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"},
    ]
    chat = _chat(http, history, tools=[CHAT_TOOL], tool_choice="none", max_tokens=16)
    assert follow_up.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert follow_up.output_text == chat["choices"][0]["message"]["content"]
    server.assert_no_leak()


def test_messages_tool_use_and_tool_result(claude, http, server) -> None:
    tool_choice = {"type": "tool", "name": "get_weather"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    message = claude.messages.create(
        model=MODEL,
        messages=messages,
        tools=[ANTHROPIC_TOOL],
        tool_choice=tool_choice,
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    with claude.messages.stream(
        model=MODEL,
        messages=messages,
        tools=[ANTHROPIC_TOOL],
        tool_choice=tool_choice,
        max_tokens=60,
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", block.input)
    ]
    follow_up = [
        *messages,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "22 C, sunny"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        messages=follow_up,
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "none"},
        max_tokens=16,
        extra_body={"temperature": 0},
    )
    history = [
        *messages,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(block.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": block.id, "content": "22 C, sunny"},
    ]
    chat = _chat(http, history, tools=[CHAT_TOOL], tool_choice="none", max_tokens=16)
    assert answer.content[0].text == chat["choices"][0]["message"]["content"]
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    server.assert_no_leak()


def test_json_schema_formats_are_chats_response_format(client, claude, http, server) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Pick a color."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    for _ in range(2):  # the second run reads the prompt from the prefix cache, as all below
        chat = _chat(http, messages, max_tokens=20, response_format=response_format)
    text = chat["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    response = client.responses.create(
        model=MODEL,
        input="Pick a color.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
        max_output_tokens=20,
        temperature=0,
    )
    assert response.output_text == text
    message = claude.messages.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        extra_body={
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert message.content[0].text == text
    server.assert_no_leak()
