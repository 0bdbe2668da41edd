"""The Llama 3.x JSON tool-call format (`--tool-call-parser llama3_json`, also `llama4_json`):
the answer is one or more call objects `{"name": ..., "parameters": {...}}` (or
`"arguments"`), separated by `;`, optionally after `<|python_tag|>`.

Owns where that section starts: at `<|python_tag|>` wherever it appears, or at a `{` that
opens the answer (a call is written instead of prose). Text after the last complete call
that is not another call is dropped, as vLLM drops it.

Must not: read JSON itself (section.py's readers do).
"""

from __future__ import annotations

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.json_stream import skip_space
from octavo.entrypoints.server.tool_parsers.section import (
    PartialCall,
    SectionToolParser,
    held_back,
    read_json_call,
)

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")


@register_tool_parser("llama4_json")
@register_tool_parser("llama3_json")
class Llama3JsonToolParser(SectionToolParser):
    def split(self, text: str) -> tuple[int, bool]:
        first = skip_space(text, 0)
        if text.startswith("{", first):
            return first, True
        tag = text.find(PYTHON_TAG)
        if tag != -1:
            return tag, True
        if first == len(text):
            return 0, False  # only whitespace so far: a call may still open the answer
        return len(text) - held_back(text, PYTHON_TAG), False

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        pos = len(PYTHON_TAG) if section.startswith(PYTHON_TAG) else 0
        calls: list[PartialCall] = []
        while True:
            read = read_json_call(section, pos, _ARGS_KEYS)
            if read is None:
                return calls or None  # after a complete call, the rest is not a call
            if read.end is None:
                if final:
                    return calls or None
                if read.call is not None:
                    calls.append(read.call)
                return calls
            assert read.call is not None
            calls.append(read.call)
            pos = skip_space(section, read.end)
            if not section.startswith(";", pos):
                return calls
            pos += 1
