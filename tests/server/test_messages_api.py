"""/v1/messages (Anthropic's Messages API) through the official `anthropic` client, over the
mock engine: each text is compared with what /v1/chat/completions answers for the same
conversation under greedy sampling; stop reasons, streaming events, count_tokens, and errors
in Anthropic's shape."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from octavo.entrypoints.server.serving_messages import _stop_reason

from .mock_server import mock_server

MESSAGES = [{"role": "user", "content": "the cat"}]
# The SDK no longer has temperature, top_p or top_k arguments; vLLM (and octavo) still take
# them in the body.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def running():
    with mock_server() as server:
        yield server


@pytest.fixture(scope="module")
def client(running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.base_url, api_key="none", timeout=30)


@pytest.fixture(scope="module")
def http(running):
    with httpx.Client(base_url=running.base_url, timeout=30) as client:
        yield client


def _chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": "mock", "messages": messages, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_plain_message_answers_as_chat_does(client, http) -> None:
    message = client.messages.create(model="mock", max_tokens=5, messages=MESSAGES, **GREEDY)
    chat = _chat(http, MESSAGES, max_tokens=5)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "mock"
    [block] = message.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = chat["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert (
        message.usage.input_tokens + message.usage.cache_read_input_tokens
        == (usage["prompt_tokens"])
    )
    assert message.usage.cache_read_input_tokens == cached
    assert message.usage.output_tokens == 5


def test_system_blocks_and_multi_turn(client, http) -> None:
    system = [{"type": "text", "text": "by the "}, {"type": "text", "text": "door"}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    message = client.messages.create(
        model="mock", max_tokens=4, system=system, messages=messages, **GREEDY
    )
    chat = _chat(
        http,
        [{"role": "system", "content": "by the door"}, *messages],
        max_tokens=4,
    )
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    as_string = client.messages.create(
        model="mock", max_tokens=4, system="by the door", messages=messages, **GREEDY
    )
    assert as_string.content[0].text == message.content[0].text


def test_stop_sequences_give_stop_sequence(client, http) -> None:
    whole = _chat(http, MESSAGES, max_tokens=8)["choices"][0]["message"]["content"]
    word = whole.split()[3]
    message = client.messages.create(
        model="mock", max_tokens=8, messages=MESSAGES, **GREEDY, stop_sequences=[word]
    )
    chat = _chat(http, MESSAGES, max_tokens=8, stop=[word])["choices"][0]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == chat["message"]["content"]
    assert word not in message.content[0].text


def test_streamed_message_equals_the_whole_one(client) -> None:
    whole = client.messages.create(model="mock", max_tokens=6, messages=MESSAGES, **GREEDY)
    with client.messages.stream(model="mock", max_tokens=6, messages=MESSAGES, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    # The SDK adds its own "text" events beside the wire's content_block_delta ones.
    wire = [kind for kind in kinds if kind != "text"]
    num_deltas = wire.count("content_block_delta")
    assert wire == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * num_deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    stopped = client.messages.create(
        model="mock", max_tokens=6, messages=MESSAGES, **GREEDY, stop_sequences=["mat"]
    )
    with client.messages.stream(
        model="mock", max_tokens=6, messages=MESSAGES, **GREEDY, stop_sequences=["mat"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "mat")
    assert final.content[0].text == stopped.content[0].text


def test_count_tokens_is_the_prompt_of_the_same_conversation(client) -> None:
    system = "by the door"
    counted = client.messages.count_tokens(model="mock", system=system, messages=MESSAGES)
    message = client.messages.create(model="mock", max_tokens=1, system=system, messages=MESSAGES)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"max_tokens": None}, 400),
        ({"max_tokens": 0}, 400),
        ({"max_tokens": "many"}, 400),
        ({"max_tokens": 100000}, 400),
        ({"temperature": -1}, 400),
        ({"top_p": 2}, 400),
        ({"stop_sequences": "mat"}, 400),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400),
        ({"tool_choice": {"type": "tool"}, "tools": [{"name": "f", "input_schema": {}}]}, 400),
        ({"tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]}, 400),
        ({"cache_salt": "salt"}, 400),
        ({"model": "no-such-model"}, 404),
    ],
)
def test_errors_have_anthropics_shape(http, fields, status) -> None:
    body = {"model": "mock", "max_tokens": 4, "messages": MESSAGES, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"]


def test_the_client_raises_the_status_error(client) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="mock", max_tokens=100000, messages=MESSAGES)


def test_stop_reason_mapping() -> None:
    """vLLM's: max_tokens wins, a matched stop string is stop_sequence, a call tool_use."""
    assert _stop_reason("length", "x", True) == ("max_tokens", None)
    assert _stop_reason("stop", "x", False) == ("stop_sequence", "x")
    assert _stop_reason("stop", None, True) == ("tool_use", None)
    assert _stop_reason("tool_calls", None, False) == ("tool_use", None)
    assert _stop_reason("stop", 2, False) == ("end_turn", None)
    assert _stop_reason("abort", None, False) == (None, None)


def test_thinking_is_a_thinking_block_whole_and_streamed() -> None:
    from octavo.entrypoints.server.app import ServerConfig

    from .test_tool_call_formats import scripted_llm

    text = "Greet back.</think>Hello there!"  # qwen3: the output starts inside the thinking
    config = ServerConfig(reasoning_parser="qwen3")
    with mock_server(config, llm=scripted_llm(text, [])) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="none", timeout=30)
        message = client.messages.create(model="mock", max_tokens=50, messages=MESSAGES)
        thinking, answer = message.content
        assert (thinking.type, thinking.thinking) == ("thinking", "Greet back.")
        assert thinking.signature
        assert (answer.type, answer.text) == ("text", "Hello there!")
        assert message.stop_reason == "end_turn"
        with client.messages.stream(model="mock", max_tokens=50, messages=MESSAGES) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert [
            (b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content
        ] == [
            ("thinking", "Greet back."),
            ("text", "Hello there!"),
        ]
        assert final.stop_reason == "end_turn"
        starts = [e.index for e in events if e.type == "content_block_start"]
        stops = [e.index for e in events if e.type == "content_block_stop"]
        assert starts == stops == [0, 1]
        signatures = [e for e in events if e.type == "signature"]
        assert len(signatures) == 1


def test_disable_parallel_tool_use_keeps_the_first_call() -> None:
    from octavo.entrypoints.server.app import ServerConfig

    from .test_tool_call_formats import scripted_llm

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = call + call.replace("Paris", "Rome")
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with mock_server(config, llm=scripted_llm(text, [])) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="none", timeout=30)
        body: dict[str, Any] = dict(model="mock", max_tokens=80, messages=MESSAGES, tools=tools)
        both = client.messages.create(**body)
        assert [b.input["city"] for b in both.content] == ["Paris", "Rome"]
        assert both.stop_reason == "tool_use"
        choice = {"type": "auto", "disable_parallel_tool_use": True}
        first = client.messages.create(**body, tool_choice=choice)
        assert [b.input["city"] for b in first.content] == ["Paris"]
        with client.messages.stream(**body, tool_choice=choice) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]
        assert final.stop_reason == "tool_use"
