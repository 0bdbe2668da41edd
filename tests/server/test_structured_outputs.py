"""Structured outputs through the official `openai` client: `response_format` (json_schema,
json_object) on chat, vLLM's `structured_outputs` (json, choice, regex, grammar) on both
endpoints, streaming and not, n > 1, beside unconstrained requests, and the 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "vip": {"type": "boolean"},
            },
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"enum": ["apple", "pear", "plum"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["customer", "items"],
    "additionalProperties": False,
}
COLORS = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 2,
    "maxItems": 3,
}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, content: str, **kwargs):
    settings = {"max_tokens": 80, "temperature": 0, **kwargs}
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **settings
    )


def json_schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("schema", [PERSON, ORDER, COLORS], ids=["person", "order", "colors"])
def test_json_schema_response_validates(client, model, schema) -> None:
    response = chat(
        client, model, "Describe it as JSON.", response_format=json_schema_format(schema)
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_equals_the_whole_one(client, model) -> None:
    # Both runs below then hit the prefix cache (see test_openai_client.py: a hit and a miss
    # compute the prompt's last rows by different kernels of the quantized weights).
    chat(client, model, "Invent a user.", response_format=json_schema_format(PERSON), max_tokens=1)
    whole = chat(client, model, "Invent a user.", response_format=json_schema_format(PERSON))
    chunks = list(
        chat(
            client, model, "Invent a user.", response_format=json_schema_format(PERSON), stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_n_samples(client, model) -> None:
    response = chat(
        client,
        model,
        "Give me some JSON.",
        response_format={"type": "json_object"},
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=60,
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # an open-ended object may run out of tokens: still a valid prefix
            assert choice.message.content.startswith("{")
    schema_n = chat(
        client,
        model,
        "Describe it.",
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"json": COLORS}},
    )
    for choice in schema_n.choices:
        jsonschema.validate(json.loads(choice.message.content), COLORS)


def test_completions_choice_regex_and_grammar(client, model) -> None:
    def complete(structured_outputs: dict, **kwargs):
        return client.completions.create(
            model=model,
            prompt="The weather today is",
            max_tokens=16,
            temperature=0,
            extra_body={"structured_outputs": structured_outputs},
            **kwargs,
        ).choices[0]

    choice = complete({"choice": ["sunny", "rainy", "cloudy"]})
    assert choice.text in ("sunny", "rainy", "cloudy") and choice.finish_reason == "stop"
    regex = complete({"regex": r"[0-9]{2} degrees"})
    assert re.fullmatch(r"[0-9]{2} degrees", regex.text) and regex.finish_reason == "stop"
    grammar = complete({"grammar": 'start: ("hot" | "cold") " and " ("dry" | "wet")'})
    assert re.fullmatch(r"(hot|cold) and (dry|wet)", grammar.text)
    streamed = client.completions.create(
        model=model,
        prompt="The weather today is",
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_unconstrained_request_in_the_same_batch_is_unaffected(client, model, server) -> None:
    def plain():
        return (
            client.completions.create(
                model=model,
                prompt="Once upon a time",
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    alone = plain()
    with ThreadPoolExecutor(6) as pool:
        structured = [
            pool.submit(
                chat, client, model, "A user, please.", response_format=json_schema_format(PERSON)
            )
            for _ in range(3)
        ]
        plains = [pool.submit(plain) for _ in range(3)]
        assert [f.result() for f in plains] == [alone] * 3
        for future in structured:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), PERSON)
    server.assert_no_leak()


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"response_format": json_schema_format({"type": "strin"})},
            "response_format",
            "response_format.json_schema is invalid: Invalid type: strin",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "response_format.json_schema.schema is required when type is 'json_schema'.",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "response_format.json_schema.schema is required when type is 'json_schema'.",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", None),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "response_format and structured_outputs cannot both be set.",
        ),
        (
            {"structured_outputs": {"regex": "(abc"}},
            "structured_outputs",
            "structured_outputs.regex is invalid: ",
        ),
        (
            {"structured_outputs": {"json": {"properties": {"a": {"$ref": "#/x"}}}}},
            "structured_outputs",
            "structured_outputs.json is invalid: Pointer '/x' does not exist",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object;"
            " got ['regex', 'choice'].",
        ),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs",
            "structured_outputs.choice must be a non-empty list of strings, got [].",
        ),
        (
            {"structured_outputs": {"grammar": "start: nothing_here"}},
            "structured_outputs",
            'structured_outputs.grammar is invalid: at 1(8): unknown name: "nothing_here"',
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_param(http, server, body, param, message) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = http.post("/v1/chat/completions", json=payload)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    if message is not None:
        assert error["message"].startswith(message)
    server.assert_no_leak()


def test_bad_constraint_on_completions_is_a_400(http) -> None:
    response = http.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "structured_outputs": {"json": '{"type": '},
        },
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "structured_outputs"
    assert error["message"].startswith("structured_outputs.json is invalid: Expecting value")
