"""/v1/responses through the official `openai` client, over the mock engine (wire format, the
response store, background mode, refusals): each text is compared with what
/v1/chat/completions answers for the same conversation under greedy sampling."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from octavo.entrypoints.server.app import ServerConfig

from .mock_server import mock_server

MESSAGES = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def running():
    with mock_server(ServerConfig(max_stored_responses=3), slow=False) as server:
        yield server


@pytest.fixture(scope="module")
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", timeout=30)


@pytest.fixture(scope="module")
def http(running):
    with httpx.Client(base_url=running.base_url, timeout=30) as client:
        yield client


def _chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": "mock", "messages": messages, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_plain_input_answers_as_chat_does(client, http) -> None:
    response = client.responses.create(
        model="mock", input="the cat", max_output_tokens=5, temperature=0
    )
    chat = _chat(http, MESSAGES, max_tokens=5)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat["choices"][0]["message"]["content"] != ""
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat["usage"]["prompt_tokens"],
        chat["usage"]["completion_tokens"],
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.max_output_tokens) == (0.0, 5)
    assert (response.tool_choice, response.tools) == ("none", [])


def test_instructions_and_message_items_are_a_chat_conversation(client, http) -> None:
    items = [
        {"role": "developer", "content": "see the dog"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
        {"role": "user", "content": "three"},
    ]
    response = client.responses.create(
        model="mock", instructions="by the door", input=items, max_output_tokens=4, temperature=0
    )
    messages = [
        {"role": "system", "content": "by the door"},
        {"role": "developer", "content": "see the dog"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    chat = _chat(http, messages, max_tokens=4)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.instructions == "by the door"


def test_stream_events_come_in_openais_order(client) -> None:
    whole = client.responses.create(
        model="mock", input="the cat", max_output_tokens=6, temperature=0
    )
    events = list(
        client.responses.create(
            model="mock", input="the cat", max_output_tokens=6, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert num_deltas >= 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type.endswith("text.delta"))
    assert deltas == whole.output_text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {final.output[0].id}


def test_retrieve_and_previous_response_id_continue_the_conversation(client, http) -> None:
    first = client.responses.create(
        model="mock", input="the cat", max_output_tokens=3, temperature=0
    )
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(
        model="mock",
        input="one two",
        previous_response_id=first.id,
        instructions="ignored next time",
        max_output_tokens=3,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "ignored next time"},
        *MESSAGES,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "one two"},
    ]
    chat = _chat(http, messages, max_tokens=3)
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.previous_response_id == first.id
    # Instructions do not carry over to the next turn (OpenAI's and vLLM's rule).
    third = client.responses.create(
        model="mock",
        input="three",
        previous_response_id=second.id,
        max_output_tokens=2,
        temperature=0,
    )
    messages = [*messages[1:], {"role": "assistant", "content": second.output_text}]
    chat = _chat(http, [*messages, {"role": "user", "content": "three"}], max_tokens=2)
    assert third.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_store_false_and_the_lru_bound(client, http) -> None:
    unstored = client.responses.create(
        model="mock", input="the cat", max_output_tokens=1, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # The server keeps 3: the oldest of four goes, a read keeps one recent.
    ids = [
        client.responses.create(model="mock", input="the cat", max_output_tokens=1).id
        for _ in range(3)
    ]
    client.responses.retrieve(ids[0])
    ids.append(client.responses.create(model="mock", input="the cat", max_output_tokens=1).id)
    assert http.get(f"/v1/responses/{ids[1]}").status_code == 404
    for kept in (ids[0], ids[2], ids[3]):
        assert http.get(f"/v1/responses/{kept}").status_code == 200
    missing = http.post("/v1/responses", json={"input": "x", "previous_response_id": ids[1]})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"cache_salt": "salt"}, "cache_salt"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": 5}, "input"),
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "background"),
        ({"service_tier": "fastest"}, "service_tier"),
    ],
)
def test_bad_and_unsupported_fields_are_400s_naming_them(http, fields, param) -> None:
    response = http.post("/v1/responses", json={"model": "mock", "input": "the cat", **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_fields_are_ignored_and_unknown_ids_are_404(http) -> None:
    body = {"model": "mock", "input": "the cat", "max_output_tokens": 1, "no_such_field": 1}
    assert http.post("/v1/responses", json=body).status_code == 200
    for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/cancel"):
        response = http.request("GET" if path.count("/") == 3 else "POST", path)
        assert response.status_code == 404
        assert response.json()["error"]["param"] == "response_id"


def test_a_finished_response_cannot_be_cancelled(client, http) -> None:
    done = client.responses.create(model="mock", input="the cat", max_output_tokens=1)
    response = http.post(f"/v1/responses/{done.id}/cancel")
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_id"


def _wait_for(client: openai.OpenAI, response_id: str, statuses: set[str]) -> Any:
    deadline = time.monotonic() + 30
    while (found := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, found.status
        time.sleep(0.05)
    return found


def test_background_runs_to_the_end_and_cancel_stops_it() -> None:
    with mock_server(replace(ServerConfig(), max_stored_responses=8), slow=True) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=30)
        queued = client.responses.create(
            model="mock", input="the cat", max_output_tokens=3, temperature=0, background=True
        )
        assert queued.status == "queued" and queued.background and queued.output == []
        done = _wait_for(client, queued.id, {"completed", "incomplete"})
        whole = client.responses.create(
            model="mock", input="the cat", max_output_tokens=3, temperature=0
        )
        assert done.output_text == whole.output_text and done.id == queued.id
        # A long one, cancelled while it runs: it ends, and the engine frees its blocks.
        long = client.responses.create(
            model="mock", input="the cat", max_output_tokens=100, background=True
        )
        _wait_for(client, long.id, {"in_progress"})
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"
        engine = server.async_engine.engine
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stats = engine.make_stats()
        assert stats.num_free_blocks == stats.num_blocks


def test_no_store_refuses_background() -> None:
    with mock_server(ServerConfig(max_stored_responses=0)) as server:
        body = {"model": "mock", "input": "the cat", "background": True}
        response = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "background"
        body = {"model": "mock", "input": "the cat", "max_output_tokens": 1}
        created = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).json()
        response = httpx.get(server.base_url + f"/v1/responses/{created['id']}", timeout=30)
        assert response.status_code == 404


# --- thinking and calls (a scripted model) ----------------------------------------------------


def _scripted(text: str, config: ServerConfig):
    from .test_tool_call_formats import scripted_llm

    return mock_server(config, llm=scripted_llm(text, []))


THINKING = "Greet back.</think>Hello there!"  # qwen3: the output starts inside the thinking
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_thinking_is_a_reasoning_item_whole_and_streamed() -> None:
    with _scripted(THINKING, ServerConfig(reasoning_parser="qwen3")) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=30)
        response = client.responses.create(model="mock", input="hi", max_output_tokens=50)
        reasoning, message = response.output
        assert reasoning.type == "reasoning"
        assert [part.text for part in reasoning.content] == ["Greet back."]
        assert message.type == "message" and response.output_text == "Hello there!"
        # "Greet back." is the model's first 3 tokens (pieces of 4 characters).
        assert response.usage.output_tokens_details.reasoning_tokens == 3
        assert response.status == "completed"
        events = list(
            client.responses.create(model="mock", input="hi", max_output_tokens=50, stream=True)
        )
        kinds = [e.type for e in events if not e.type.endswith(".delta")]
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thinking == "Greet back."
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert final.output_text == "Hello there!"
        assert final.usage.output_tokens_details.reasoning_tokens == 3
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        hidden = client.responses.create(
            model="mock", input="hi", max_output_tokens=50, extra_body={"include_reasoning": False}
        )
        assert [item.type for item in hidden.output] == ["message"]


def test_an_auto_call_after_text_is_a_function_call_item() -> None:
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    with _scripted(f"Checking.{CALL}", config) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=30)
        response = client.responses.create(
            model="mock", input="weather?", tools=[tool], max_output_tokens=80
        )
        message, call = response.output
        assert message.type == "message" and response.output_text == "Checking."
        assert (call.type, call.name, json.loads(call.arguments)) == (
            "function_call",
            "get_weather",
            {"city": "Paris"},
        )
        events = list(
            client.responses.create(
                model="mock", input="weather?", tools=[tool], max_output_tokens=80, stream=True
            )
        )
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [item.type for item in done] == ["message", "function_call"]
        assert json.loads(done[1].arguments) == {"city": "Paris"}
        arguments = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert arguments == done[1].arguments
        assert events[-1].response.output[1].call_id == done[1].call_id


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    second = CALL.replace("Paris", "Rome")
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    with _scripted(CALL + second, config) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=30)
        body: dict[str, Any] = dict(model="mock", input="w?", tools=[tool], max_output_tokens=80)
        both = client.responses.create(**body)
        assert [json.loads(i.arguments)["city"] for i in both.output] == ["Paris", "Rome"]
        first = client.responses.create(**body, parallel_tool_calls=False)
        assert [json.loads(i.arguments)["city"] for i in first.output] == ["Paris"]
        assert first.parallel_tool_calls is False
        events = list(client.responses.create(**body, parallel_tool_calls=False, stream=True))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [json.loads(item.arguments)["city"] for item in done] == ["Paris"]


def test_retrieve_does_not_stream(client, http) -> None:
    done = client.responses.create(model="mock", input="the cat", max_output_tokens=1)
    response = http.get(f"/v1/responses/{done.id}", params={"stream": "true"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"


def test_max_stored_responses_flag() -> None:
    from octavo.entrypoints.cli import make_parser, server_config_from

    parse = make_parser().parse_args
    assert server_config_from(parse(["serve"])).max_stored_responses == 1000
    ns = parse(["serve", "--max-stored-responses", "0"])
    assert server_config_from(ns).max_stored_responses == 0
    with pytest.raises(ValueError, match="max_stored_responses"):
        ServerConfig(max_stored_responses=-1)


def test_a_client_that_leaves_a_stream_aborts_its_request() -> None:
    """Both new streams read the chat run through aclosing: a client gone mid-stream aborts
    the engine request and frees its blocks."""
    bodies = {
        "/v1/responses": {"model": "mock", "input": "the cat", "max_output_tokens": 100},
        "/v1/messages": {"model": "mock", "messages": MESSAGES, "max_tokens": 100},
    }
    with mock_server(slow=True) as server:
        engine = server.async_engine.engine
        for path, body in bodies.items():
            with (
                httpx.Client(base_url=server.base_url, timeout=30) as http,
                http.stream("POST", path, json={**body, "stream": True}) as response,
            ):
                lines = response.iter_lines()
                deltas = 0
                while deltas < 3:
                    deltas += "delta" in next(lines)
            # Unaborted, the 100 tokens would take another ~5 s (0.05 s a step).
            deadline = time.monotonic() + 2
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline, path
                time.sleep(0.05)
            stats = engine.make_stats()
            assert stats.num_free_blocks == stats.num_blocks
