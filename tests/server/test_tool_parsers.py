"""Tool parsers on hand-written model text, no model: the Hermes markup parser (whole answers,
several calls, malformed JSON coming back as content, streaming in every chunking), the parsers
for outputs forced by tool_choice, and the incremental JSON reading under them."""

from __future__ import annotations

import json
import random
import re

import pytest

from octavo.entrypoints.server.tool_parsers import (
    DeltaUpdate,
    HermesToolParser,
    NamedToolParser,
    RequiredToolsParser,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    merge_updates,
)
from octavo.entrypoints.server.tool_parsers.json_stream import decode_value, scan_object

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TIME = '{"name": "get_time", "arguments": {"tz": "CET"}}'
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def calls(extracted) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in extracted.tool_calls]


def stream(parser: ToolParser, text: str, sizes: list[int]) -> list[DeltaUpdate]:
    updates, pos = [], 0
    for size in sizes:
        updates.append(parser.feed(text[pos : pos + size]))
        pos += size
    assert pos >= len(text)
    updates.append(parser.finish())
    return updates


def chunkings(text: str) -> list[list[int]]:
    """One character at a time, the whole text at once, and 20 seeded random splits."""
    rng = random.Random(0)
    result = [[1] * len(text), [len(text)]]
    for _ in range(20):
        sizes, total = [], 0
        while total < len(text):
            sizes.append(rng.randint(1, 6))
            total += sizes[-1]
        result.append(sizes)
    return result


# --- hermes: whole answers ------------------------------------------------------------------


def test_registry_finds_hermes_and_names_the_flag_otherwise() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*hermes.*; got 'x'"):
        get_tool_parser("x")


def test_hermes_one_call_after_text() -> None:
    text = f"Let me look that up.\n<tool_call>\n{WEATHER}\n</tool_call>"
    extracted = HermesToolParser().extract(text)
    assert extracted.content == "Let me look that up."
    assert calls(extracted) == [("get_weather", '{"city": "Paris", "days": [1, 2]}')]
    assert ID.fullmatch(extracted.tool_calls[0].id)


def test_hermes_several_calls_in_one_answer_get_distinct_ids() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    extracted = HermesToolParser().extract(text)
    assert extracted.content is None
    assert calls(extracted) == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert len({call.id for call in extracted.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "Sure <tool_call>{not json}</tool_call> done",
        '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
    ],
)
def test_hermes_malformed_call_comes_back_as_content(text: str) -> None:
    extracted = HermesToolParser().extract(text)
    assert extracted.content == text
    assert extracted.tool_calls == []


def test_hermes_good_call_beside_a_malformed_one() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{oops</tool_call>"
    extracted = HermesToolParser().extract(text)
    assert extracted.content == "<tool_call>{oops</tool_call>"
    assert calls(extracted) == [("get_weather", '{"city": "Paris", "days": [1, 2]}')]


def test_hermes_unclosed_last_call_and_call_without_arguments() -> None:
    assert calls(HermesToolParser().extract(f"<tool_call>{TIME}")) == [
        ("get_time", '{"tz": "CET"}')
    ]
    assert calls(HermesToolParser().extract('<tool_call>{"name": "now"}</tool_call>')) == [
        ("now", "{}")
    ]


def test_hermes_text_without_calls_is_untouched() -> None:
    for text in ["plain answer", "a < b and <tool but no call", "ends with <tool_ca", ""]:
        extracted = HermesToolParser().extract(text)
        assert (extracted.content, extracted.tool_calls) == (text or None, [])


# --- hermes: streaming ----------------------------------------------------------------------

STREAM_TEXTS = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>{TIME}</tool_call> and then some text\n",
    "no calls here, only a < sign and <tool_c",
    f"Text <tool_call>not json</tool_call> more <tool_call>{WEATHER}",
    '<tool_call>{"name": "now"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"s": "quote \\" brace } tag </tool", "n": -1.5e3}}'
    "</tool_call>",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_hermes_stream_reassembles_to_the_whole_answer_in_every_chunking(text: str) -> None:
    whole = HermesToolParser().extract(text)
    for sizes in chunkings(text):
        updates = stream(HermesToolParser(), text, sizes)
        merged = merge_updates(updates)
        assert (merged.content, calls(merged)) == (whole.content, calls(whole)), sizes
        firsts = [d for u in updates for d in u.tool_calls if d.id is not None]
        assert [d.index for d in firsts] == list(range(len(whole.tool_calls)))
        assert all(ID.fullmatch(d.id) and d.name and d.arguments == "" for d in firsts)


def test_hermes_stream_holds_back_a_possible_tag_and_never_sends_markup() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hello <tool") == DeltaUpdate("Hello", [])
    assert parser.feed("_call>") == DeltaUpdate("", [])
    first = parser.feed('{"name": "get_time", "arguments": {"tz"')
    assert first.content == ""
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_time", ""),
        (0, None, '{"tz"'),
    ]
    assert parser.feed(': "CET"}}</tool_') == DeltaUpdate(
        "", [ToolCallDelta(0, arguments=': "CET"}')]
    )
    assert parser.feed("call>") == DeltaUpdate("", [])
    assert parser.finish() == DeltaUpdate("", [])


def test_hermes_stream_releases_a_false_tag_start_as_content() -> None:
    parser = HermesToolParser()
    assert parser.feed("a <tool_") == DeltaUpdate("a", [])
    assert parser.feed("box> b") == DeltaUpdate(" <tool_box> b", [])
    assert parser.finish() == DeltaUpdate("", [])


def test_hermes_stream_sends_arguments_as_fragments() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>"
    updates = stream(HermesToolParser(), text, [1] * len(text))
    pieces = [d.arguments for u in updates for d in u.tool_calls if d.id is None]
    assert len(pieces) > 10
    assert "".join(pieces) == '{"city": "Paris", "days": [1, 2]}'


# --- forced by tool_choice ------------------------------------------------------------------


def test_named_parser_whole_and_streamed() -> None:
    text = ' {"city": "Paris"} \n'
    whole = NamedToolParser("get_weather").extract(text)
    assert (whole.content, calls(whole)) == (None, [("get_weather", '{"city": "Paris"}')])
    for sizes in chunkings(text):
        updates = stream(NamedToolParser("get_weather"), text, sizes)
        assert calls(merge_updates(updates)) == calls(whole)
        first = next(d for u in updates for d in u.tool_calls)
        assert (first.name, first.arguments) == ("get_weather", "")
    assert calls(NamedToolParser("f").extract("not json")) == []
    assert NamedToolParser("f").extract("not json").content == "not json"


def test_required_parser_whole_and_streamed() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    whole = RequiredToolsParser().extract(text)
    assert (whole.content, calls(whole)) == (
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    )
    for sizes in chunkings(text):
        assert calls(merge_updates(stream(RequiredToolsParser(), text, sizes))) == calls(whole)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"name": "f", "parameters": {}}',
        '[{"name": "f"}]',
        '[{"name": "f", "parameters": {}, "x": 1}]',
        '[{"name": "f", "parameters": {}}',
    ],
)
def test_required_parser_gives_content_for_anything_but_a_call_list(text: str) -> None:
    extracted = RequiredToolsParser().extract(text)
    assert (extracted.content, extracted.tool_calls) == (text, [])


# --- incremental JSON -----------------------------------------------------------------------


def test_scan_object_spans_and_the_value_being_written() -> None:
    text = '{"name": "f", "arguments": {"a": [1, "x'
    scan = scan_object(text)
    assert scan.members == {"name": (9, 12)}
    assert (scan.open_key, scan.open_start, scan.end, scan.malformed) == (
        "arguments",
        27,
        None,
        False,
    )
    done = scan_object(text + '"]}}')
    assert done.members["arguments"] == (27, 42) and done.end == 43
    assert scan_object('{"a": 1 "b"').malformed
    assert scan_object("[1]").malformed


@pytest.mark.parametrize(
    "text,expected",
    [
        ("12", None),
        ("12,", (12, 2)),
        ("tr", None),
        ('"a\\u00', None),
        ("-", None),
        ('{"a": [1, 2', None),
        ('{"a": 1}', ({"a": 1}, 8)),
        ("true", (True, 4)),
    ],
)
def test_decode_value_tells_unfinished_from_complete(text: str, expected) -> None:
    assert decode_value(text, 0) == expected


@pytest.mark.parametrize("text", ["{x}", '{"a": Paris}', "[1 2]", '"\\q"'])
def test_decode_value_rejects_what_no_continuation_can_fix(text: str) -> None:
    with pytest.raises(ValueError):
        decode_value(text, 0)


def test_merged_arguments_are_json() -> None:
    merged = merge_updates(stream(HermesToolParser(), STREAM_TEXTS[0], [3] * 62))
    assert [json.loads(call.arguments) for call in merged.tool_calls] == [
        {"city": "Paris", "days": [1, 2]},
        {"tz": "CET"},
    ]
