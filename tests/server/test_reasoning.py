"""--reasoning-parser (qwen3, deepseek_r1): each parser on hand-written model text, whole and
streamed in every chunking (the thinking and answer pieces, joined, equal the whole result)."""

from __future__ import annotations

from typing import Any

import pytest

from octavo.entrypoints.server.reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_for,
)

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
        ("No thinking here.", None, "No thinking here."),
        ("Before <think>mid</think> after", "mid", "Before  after"),
        ("<think>cut off", "cut off", None),
        ("an unopened </think> stays", None, "an unopened </think> stays"),
        ("<thin k> and <think", None, "<thin k> and <think"),
        ("<think></think>x", None, "x"),
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
    assert parser.feed("Hi <th") == ReasoningDelta("", "Hi ")
    assert parser.feed("ink>x </") == ReasoningDelta("x ", "")
    assert parser.feed("think>y") == ReasoningDelta("", "y")
    assert parser.finish() == ReasoningDelta()


def test_parser_names_and_enable_thinking() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
    assert reasoning_parser_for(None, {}) is None
    assert reasoning_parser_for("qwen3", {"enable_thinking": False}) is None
    assert reasoning_parser_for("qwen3", {"enable_thinking": True}) is not None
    # DeepSeek-R1's template has no switch: the parser stays on.
    assert reasoning_parser_for("deepseek_r1", {"enable_thinking": False}) is not None
