# ruff: noqa: RUF001 (DeepSeek's markers are written with fullwidth bars)
"""The tool-call formats of vLLM's other parsers (llama3_json, mistral, pythonic, qwen3_xml /
qwen3_coder, deepseek_v3, granite): each on hand-written model text, whole and streamed in
every chunking (the same content and calls either way), what is not a call coming back as
content, and end to end through /v1/chat/completions over a mock model that writes a
scripted answer, streamed and not."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from octavo import LLM
from octavo.config import CacheConfig, EngineConfig, SchedulerConfig
from octavo.core.mock_runner import MockRunner
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.app import ServerConfig
from octavo.entrypoints.server.tool_parsers import get_tool_parser, merge_updates
from octavo.entrypoints.server.tool_parsers.qwen3 import convert_value

from ..mock_engine import CHAT_TEMPLATE
from .mock_server import mock_server
from .test_tool_parsers import calls, chunkings, stream

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hot": {"type": "boolean"},
                    "scale": {"type": "number"},
                    "spots": {"type": "array"},
                    "note": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
WEATHER = ("get_weather", '{"city": "Paris", "days": 3}')
NOW = ("now", "{}")
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"

# Per parser: answers with calls -> (content, calls) in the whole answer.
WELL_FORMED: dict[str, list[tuple[str, str | None, list[tuple[str, str]]]]] = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [WEATHER]),
        (
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}; '
            '{"name": "now", "parameters": {}}',
            None,
            [WEATHER, NOW],
        ),
        (
            'Let me check. <|python_tag|>{"name": "now", "parameters": {}}',
            "Let me check.",
            [NOW],
        ),
    ],
    "mistral": [
        (
            'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 3}}, {"name": "now", "arguments": {}}]',
            "Checking.",
            [WEATHER, NOW],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}',
            None,
            [WEATHER, NOW],
        ),
        ('Sure [TOOL_CALLS]get_weather{"city": "Paris", "days": 3}', "Sure", [WEATHER]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), now()]', None, [WEATHER, NOW]),
        (
            "[get_weather(city='a, ]) \"b\"', spots=(1, -2.5, None, True), note={'k': [1]})]",
            None,
            [
                (
                    "get_weather",
                    '{"city": "a, ]) \\"b\\"", "spots": [1, -2.5, null, true], "note": {"k": [1]}}',
                )
            ],
        ),
    ],
    "qwen3_coder": [
        (
            "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=now>\n</function>\n</tool_call>",
            "I will look.",
            [WEATHER, NOW],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nLine 1\nLine 2\n</parameter>"
            "\n<parameter=hot>\nTrue\n</parameter>\n<parameter=scale>\n2.50\n</parameter>\n"
            '<parameter=spots>\n["a", 1]\n</parameter>\n<parameter=note>\n{"k": null}\n'
            "</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
            None,
            [
                (
                    "get_weather",
                    '{"city": "Line 1\\nLine 2", "hot": true, "scale": 2.5, "spots": ["a", 1], '
                    '"note": {"k": null}, "extra": "7"}',
                )
            ],
        ),
        (
            # Without the wrapper, and a parameter left unclosed before the function's end.
            "Hm <function=get_weather>\n<parameter=days>\n3\n</function>",
            "Hm",
            [("get_weather", '{"days": 3}')],
        ),
    ],
    "deepseek_v3": [
        (
            "Looking.<｜tool▁calls▁begin｜>"
            + DS_CALL.format("get_weather", '{"city": "Paris", "days": 3}')
            + DS_CALL.format("now", "{}")
            + "<｜tool▁calls▁end｜>",
            "Looking.",
            [WEATHER, NOW],
        ),
        (
            "<｜tool▁calls▁begin｜>"
            + DS_CALL.format("get_weather", '{"city": "Paris", "days": 3}')
            + "<｜tool▁calls▁end｜>",
            None,
            [WEATHER],
        ),
    ],
    "granite": [
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "now", "arguments": {}}]',
            None,
            [WEATHER, NOW],
        ),
        (
            ' <tool_call> [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
            None,
            [WEATHER],
        ),
        ('[{"name": "now", "arguments": {}}]', None, [NOW]),
    ],
}
WELL_FORMED["qwen3_xml"] = WELL_FORMED["qwen3_coder"]
WELL_FORMED["llama4_json"] = WELL_FORMED["llama3_json"][:1]

# Per parser: answers that hold no well-formed call, so all of them is content.
NOT_CALLS: dict[str, list[str]] = {
    "llama3_json": [
        "plain text, no calls",
        '{"answer": 42}',
        '{"name": "Bob"}',
        '{"name": "f", "parameters": [1]}',
        'Use {"name": "f", "parameters": {}} like this',
    ],
    "mistral": [
        "no calls here [TOOL",
        "[TOOL_CALLS]",
        "[TOOL_CALLS]get_weather",
        '[TOOL_CALLS]bad name{"a": 1}',
    ],
    "pythonic": [
        "[]",
        "[1, 2]",
        "see [f()]",
        "[os.system(a='x')]",
    ],
    "qwen3_coder": ["text", "<tool_call>\n</tool_call>", "<tool_call>\n<function=f"],
    "deepseek_v3": [
        "text",
        "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function",
    ],
    "granite": [
        "plain",
        "<|tool_call|>",
        "<|tool_call|> nothing",
        "[1]",
        '[{"name": "f", "parameters": {}}]',
        'Text [{"name": "f", "arguments": {}}]',
    ],
}
NOT_CALLS["qwen3_xml"] = NOT_CALLS["qwen3_coder"]
# Answers whose first call looks well-formed until its end: whole, they are content; a
# stream has sent the call's id, name and arguments so far before that, and cannot recall them.
SPOILED_LATE = [
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] and more'),
    ("mistral", '[TOOL_CALLS]f{"a": 1,}'),
    ("pythonic", "[f(a=1)] and text"),
    ("pythonic", "[f(1)]"),
    ("pythonic", "[f(a=g())]"),
    ("pythonic", "[f(a={1, 2})]"),
    ("pythonic", "[f(a=1)"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", "not json")),
    ("granite", '[{"name": "f", "arguments": {}}] trailing'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", '{"a": 1}}')),
]
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _cases(table: dict[str, list[Any]]) -> list[tuple[str, Any]]:
    return [(name, case) for name, cases in table.items() for case in cases]


@pytest.mark.parametrize("parser_name,case", _cases(WELL_FORMED))
def test_calls_whole_and_streamed_in_every_chunking(parser_name: str, case) -> None:
    text, content, expected = case
    parser_cls = get_tool_parser(parser_name)
    whole = parser_cls(TOOLS).extract(text)
    assert (whole.content, calls(whole)) == (content, expected)
    id_pattern = MISTRAL_ID if parser_name == "mistral" else ID
    assert all(id_pattern.fullmatch(call.id) for call in whole.tool_calls)
    assert len({call.id for call in whole.tool_calls}) == len(expected)
    for sizes in chunkings(text):
        updates = stream(parser_cls(TOOLS), text, sizes)
        merged = merge_updates(updates)
        assert (merged.content, calls(merged)) == (content, expected), sizes
        firsts = [d for u in updates for d in u.tool_calls if d.id is not None]
        assert [d.index for d in firsts] == list(range(len(expected)))
        assert all(id_pattern.fullmatch(d.id) and d.name and d.arguments == "" for d in firsts)


@pytest.mark.parametrize("parser_name,text", _cases(NOT_CALLS))
def test_what_is_not_a_call_is_content_whole_and_streamed(parser_name: str, text: str) -> None:
    parser_cls = get_tool_parser(parser_name)
    whole = parser_cls(TOOLS).extract(text)
    assert (whole.content, whole.tool_calls) == (text, [])
    for sizes in chunkings(text):
        merged = merge_updates(stream(parser_cls(TOOLS), text, sizes))
        assert (merged.content, merged.tool_calls) == (text, []), sizes


@pytest.mark.parametrize("parser_name,text", SPOILED_LATE)
def test_a_call_spoiled_at_its_end_is_content_whole_and_kept_as_sent_streamed(
    parser_name: str, text: str
) -> None:
    parser_cls = get_tool_parser(parser_name)
    whole = parser_cls(TOOLS).extract(text)
    assert (whole.content, whole.tool_calls) == (text, [])
    merged = merge_updates(stream(parser_cls(TOOLS), text, [1] * len(text)))
    assert merged.content is None and [c.name for c in merged.tool_calls] == ["f"]


def test_streamed_arguments_come_in_fragments_and_markup_never_in_content() -> None:
    text = (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]now[ARGS]{"x": [1, 2, 3]}'
    )
    updates = stream(get_tool_parser("mistral")(TOOLS), text, [1] * len(text))
    assert "".join(u.content for u in updates) == "Sure."
    pieces = [d.arguments for u in updates for d in u.tool_calls if d.index == 0 and not d.id]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "days": 3}'
    text = "Hi <｜tool▁calls▁begin｜>" + DS_CALL.format("now", "{}")
    updates = stream(get_tool_parser("deepseek_v3")(), text, [1] * len(text))
    assert "".join(u.content for u in updates) == "Hi"


def test_pythonic_sends_the_name_before_the_call_is_complete() -> None:
    parser = get_tool_parser("pythonic")()
    assert parser.feed("[get_weather(ci").tool_calls[0].name == "get_weather"
    assert parser.feed('ty="Paris")').tool_calls[0].arguments == '{"city": "Paris"}'
    assert parser.feed("]").tool_calls == []
    assert parser.finish().tool_calls == []


def test_qwen3_values_follow_the_schema_types() -> None:
    assert convert_value("42", "integer") == 42
    assert convert_value("4x", "integer") == "4x"
    assert convert_value("3.0", "number") == 3 and convert_value("0.5", "number") == 0.5
    assert convert_value("nan", "number") == "nan"
    assert convert_value("False", "boolean") is False
    assert convert_value("[1, 2]", "array") == [1, 2]
    assert convert_value("{'a': 1}", "object") == {"a": 1}
    assert convert_value("null", "string") is None
    assert convert_value("007", "string") == "007"
    assert convert_value("007", None) == "007"


def test_parsers_read_the_request_tools() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    assert calls(get_tool_parser("qwen3_coder")(TOOLS).extract(text)) == [
        ("get_weather", '{"days": 3}')
    ]
    assert calls(get_tool_parser("qwen3_coder")().extract(text)) == [
        ("get_weather", '{"days": "3"}')
    ]


# --- end to end through the server ------------------------------------------------------------


class ScriptedRunner(MockRunner):
    """The mock model writing its script from the first output token on, then EOS."""

    def _sample(self, request_id, state, mask) -> int:
        position = state.num_output_tokens
        return self.script[position] if position < len(self.script) else self.eos_token_id


SPECIAL = ["<unk>", "<s>", "</s>"]
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|tool_call|>"]


def scripted_llm(text: str, special: list[str]) -> LLM:
    """An LLM whose model writes `text` (markers as single tokens, the rest in pieces of up to
    4 characters); the tokens in `special` are special tokens, dropped when decoding skips
    them."""
    pieces: list[str] = []
    for part in re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", text):
        if part in MARKERS:
            pieces.append(part)
        else:
            pieces.extend(part[i : i + 4] for i in range(0, len(part), 4))
    vocab = SPECIAL + sorted(set(pieces))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=special,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    eos = vocab.index("</s>")
    config = EngineConfig(
        model="mock",
        served_model_name="mock",
        dtype="float32",
        dtype_reason="a mock model",
        device="cpu",
        seed=0,
        cache=CacheConfig(16, 64),
        scheduler=SchedulerConfig(4, 256, 512),
    )
    runner = ScriptedRunner(len(vocab), eos, script=[vocab.index(p) for p in pieces])
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine(config, runner, tokenizer, (eos,))
    return llm


def _reassemble(text: str) -> tuple[str, list[dict[str, Any]], str | None]:
    content, folded, finish = "", {}, None
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for event in map(json.loads, lines[:-1]):
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls", []):
                if piece["index"] not in folded:
                    assert set(piece) == {"index", "id", "type", "function"}, piece
                    folded[piece["index"]] = {"id": piece["id"], **piece["function"]}
                else:
                    assert set(piece) == {"index", "function"}, piece
                    folded[piece["index"]]["arguments"] += piece["function"]["arguments"]
            finish = choice.get("finish_reason") or finish
    return content, [folded[i] for i in sorted(folded)], finish


E2E = {
    "llama3_json": (WELL_FORMED["llama3_json"][1], ["<|python_tag|>"]),
    "mistral": (WELL_FORMED["mistral"][1], ["[TOOL_CALLS]", "[ARGS]"]),
    "pythonic": (WELL_FORMED["pythonic"][0], []),
    "qwen3_xml": (WELL_FORMED["qwen3_xml"][0], []),
    "qwen3_coder": (WELL_FORMED["qwen3_coder"][1], []),
    "deepseek_v3": (WELL_FORMED["deepseek_v3"][0], []),
    "granite": (WELL_FORMED["granite"][0], []),
}


@pytest.mark.parametrize("parser_name", sorted(E2E))
def test_chat_completions_with_each_parser_streamed_and_not(parser_name: str) -> None:
    """The markers that are special tokens in the scripted tokenizer reach the mistral parser
    only because it turns skip_special_tokens off; the others' answers read without them."""
    (text, content, expected), special = E2E[parser_name]
    config = ServerConfig(tool_call_parser=parser_name, enable_auto_tool_choice=True)
    body = {
        "model": "mock",
        "messages": [{"role": "user", "content": "weather in Paris"}],
        "tools": TOOLS,
        "max_tokens": 300,
    }
    with (
        mock_server(config, llm=scripted_llm(text, special)) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert message["content"] == content
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert got == expected
        assert all(c["type"] == "function" for c in message["tool_calls"])
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        stream_content, stream_calls, finish = _reassemble(streamed.text)
    assert (stream_content, finish) == (content or "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in stream_calls] == expected
    id_pattern = MISTRAL_ID if parser_name == "mistral" else ID
    assert all(id_pattern.fullmatch(c["id"]) for c in stream_calls + message["tool_calls"])


def test_parallel_tool_calls_false_keeps_a_chats_first_call_streamed_and_not() -> None:
    """Two hermes calls in the answer: both without the field, the first alone with
    parallel_tool_calls false, in the whole answer and in the stream."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = {
        "model": "mock",
        "messages": [{"role": "user", "content": "weather in Paris and Rome"}],
        "tools": TOOLS,
        "max_tokens": 300,
    }
    with (
        mock_server(config, llm=scripted_llm(call % "Paris" + call % "Rome", [])) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):

        def cities(fields: dict[str, Any]) -> tuple[list[str], list[str]]:
            whole = client.post("/v1/chat/completions", json={**body, **fields}).json()
            streamed = client.post("/v1/chat/completions", json={**body, **fields, "stream": True})
            _, stream_calls, finish = _reassemble(streamed.text)
            assert whole["choices"][0]["finish_reason"] == finish == "tool_calls"
            message = whole["choices"][0]["message"]
            return (
                [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]],
                [json.loads(c["arguments"])["city"] for c in stream_calls],
            )

        assert cities({}) == (["Paris", "Rome"], ["Paris", "Rome"])
        assert cities({"parallel_tool_calls": True}) == (["Paris", "Rome"], ["Paris", "Rome"])
        assert cities({"parallel_tool_calls": False}) == (["Paris"], ["Paris"])
