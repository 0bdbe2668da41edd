"""--reasoning-parser (qwen3, deepseek_r1): each parser on hand-written model text, whole and
streamed in every chunking (the thinking and answer pieces, joined, equal the whole result),
and end to end through /v1/chat/completions over a mock model that writes a scripted answer:
thinking in `reasoning` (its own deltas when streamed, never in content), a tool call after
the thinking, qwen3 with thinking turned off, and an output constraint refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from octavo.entrypoints.server.app import ServerConfig
from octavo.entrypoints.server.reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_for,
)

from .mock_server import mock_server
from .test_tool_call_formats import TOOLS, scripted_llm
from .test_tool_parsers import chunkings

# Per parser: output -> (thinking, answer).
CASES: dict[str, list[tuple[str, str | None, str | None]]] = {
    "deepseek_r1": [
        ("Let me see.\n</think>\n\nParis.", "Let me see.\n", "\n\nParis."),
        ("<think>Hm, 2+2.</think>4", "Hm, 2+2.", "4"),
        ("\n<think>a</think>b", "\na", "b"),
        ("still thinking when cut off", "still thinking when cut off", None),
        ("</think>only answer", None, "only answer"),
        ("a </thi nk> b</think>c <think> d </think> e", "a </thi nk> b", "c <think> d </think> e"),
        ("", None, None),
    ],
    "qwen3": [
        ("<think>\nI should greet.\n</think>\n\nHello!", "\nI should greet.\n", "\n\nHello!"),
        ("Opened by the template.</think>Answer.", "Opened by the template.", "Answer."),
        ("no closing tag: all thinking", "no closing tag: all thinking", None),
        ("<think>cut off", "cut off", None),
        ("<think></think>x", None, "x"),
        ("Look it up.<tool_call>{}</tool_call>", "Look it up.", "<tool_call>{}</tool_call>"),
        ("<think>a</think>b<tool_call>c", "a", "b<tool_call>c"),
        ("<tool_ca ll> and <tool_call", "<tool_ca ll> and <tool_call", None),
    ],
}


def _cases() -> list[tuple[str, Any]]:
    return [(name, case) for name, cases in CASES.items() for case in cases]


def _stream(parser: ReasoningParser, text: str, sizes: list[int]) -> list[ReasoningDelta]:
    deltas, pos = [], 0
    for size in sizes:
        deltas.append(parser.feed(text[pos : pos + size]))
        pos += size
    deltas.append(parser.finish())
    return deltas


@pytest.mark.parametrize("name,case", _cases())
def test_each_parser_whole_and_in_every_chunking(name: str, case) -> None:
    text, reasoning, content = case
    parser_cls = get_reasoning_parser(name)
    assert parser_cls().extract(text) == (reasoning, content)
    for sizes in chunkings(text) if text else [[]]:
        deltas = _stream(parser_cls(), text, sizes)
        joined = (
            "".join(d.reasoning for d in deltas) or None,
            "".join(d.content for d in deltas) or None,
        )
        assert joined == (reasoning, content), sizes


def test_a_tag_split_across_deltas_is_held_back_not_sent() -> None:
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("<th") == ReasoningDelta("", "")
    assert parser.feed("ink>x </") == ReasoningDelta("x ", "")
    assert parser.feed("think>y <tool_") == ReasoningDelta("", "y <tool_")
    assert parser.finish() == ReasoningDelta()


def test_parser_names_and_enable_thinking() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")
    assert reasoning_parser_for(None, {}) is None
    assert reasoning_parser_for("qwen3", {"enable_thinking": False}) is None
    assert reasoning_parser_for("qwen3", {"enable_thinking": True}) is not None
    # DeepSeek-R1's template has no switch: the parser stays on.
    assert reasoning_parser_for("deepseek_r1", {"enable_thinking": False}) is not None


# --- end to end through the server ------------------------------------------------------------


def _reassemble(text: str) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """A stream's thinking, content, calls and finish reason, checking that no delta mixes
    thinking with content or calls."""
    reasoning, content, calls, finish = "", "", {}, None
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for event in map(json.loads, lines[:-1]):
        for choice in event["choices"]:
            delta = choice["delta"]
            assert "reasoning_content" not in delta
            if delta.get("reasoning"):
                assert not delta.get("content") and not delta.get("tool_calls"), delta
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                call["name"] += piece["function"].get("name") or ""
                call["arguments"] += piece["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def _ask(config: ServerConfig, text: str, **extra: Any) -> tuple[httpx.Response, httpx.Response]:
    """The scripted model's answer to one chat request, whole and streamed."""
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], **extra}
    with (
        mock_server(config, llm=scripted_llm(text, [])) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):
        whole = client.post("/v1/chat/completions", json=body)
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    return whole, streamed


@pytest.mark.parametrize(
    "name,text,reasoning,content",
    [
        ("deepseek_r1", "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "\n\nIt is 4."),
        ("qwen3", "<think>Greet back.</think>Hello there!", "Greet back.", "Hello there!"),
    ],
)
def test_thinking_goes_to_reasoning_whole_and_streamed(
    name: str, text: str, reasoning: str, content: str
) -> None:
    whole, streamed = _ask(ServerConfig(reasoning_parser=name), text, max_tokens=100)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    message = body["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    assert "reasoning_content" not in message
    assert body["choices"][0]["finish_reason"] == "stop"
    # The thinking is counted in completion_tokens; vLLM gives no reasoning_tokens.
    assert "completion_tokens_details" not in body["usage"]
    assert streamed.status_code == 200, streamed.text
    assert _reassemble(streamed.text) == (reasoning, content, [], "stop")


def test_a_tool_call_after_the_thinking_whole_and_streamed() -> None:
    """The tool parser reads only the answer: a call written inside deepseek_r1's thinking is
    thinking. (qwen3's thinking ends at a `<tool_call>`, as vLLM's: CASES.)"""
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    text = f"<think>Maybe {call}? Yes.</think>Checking.{call}"
    config = ServerConfig(
        reasoning_parser="deepseek_r1", tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    whole, streamed = _ask(config, text, tools=TOOLS, max_tokens=200)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == f"Maybe {call}? Yes."
    assert message["content"] == "Checking."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("now", "{}")]
    assert choice["finish_reason"] == "tool_calls"
    reasoning, content, stream_calls, finish = _reassemble(streamed.text)
    assert (reasoning, content, finish) == (f"Maybe {call}? Yes.", "Checking.", "tool_calls")
    assert stream_calls == [{"name": "now", "arguments": "{}"}]


def test_qwen3_with_thinking_off_is_all_content() -> None:
    text = "<think>x</think>Plain answer."
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 100}
    whole, streamed = _ask(ServerConfig(reasoning_parser="qwen3"), text, **kwargs)
    message = whole.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}
    assert _reassemble(streamed.text) == ("", text, [], "stop")


def test_without_a_reasoning_parser_thinking_stays_in_content() -> None:
    text = "<think>x</think>y"
    whole, streamed = _ask(ServerConfig(), text, max_tokens=100)
    assert whole.json()["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert _reassemble(streamed.text) == ("", text, [], "stop")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}},
            "tool_choice",
        ),
    ],
)
def test_an_output_constraint_with_thinking_on_is_a_400(extra: dict, param: str) -> None:
    """The constraint would hold over the thinking too: refused, never silently wrong; with
    qwen3's thinking turned off the request is handled as without a reasoning parser."""
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    body.update(extra)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with (
        mock_server(ServerConfig(reasoning_parser="qwen3")) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
            assert "reasoning-parser" in response.json()["error"]["message"]
        thinking_off = client.post("/v1/chat/completions", json={**body, **off})
    with (
        mock_server() as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):
        no_parser = client.post("/v1/chat/completions", json=body)
    # Handled as without a reasoning parser (the mock tokenizer takes no constraint at all).
    assert "reasoning-parser" not in thinking_off.text
    assert (thinking_off.status_code, thinking_off.json()["error"]["param"]) == (
        no_parser.status_code,
        no_parser.json()["error"]["param"],
    )
