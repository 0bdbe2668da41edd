"""IBM Granite's tool-call format (`--tool-call-parser granite`): the answer is a JSON array
of `{"name": ..., "arguments": {...}}` objects, after `<|tool_call|>` (Granite 3.0) or
`<tool_call>` (Granite 3.1), or bare.

Owns where that section starts: the answer opens with the marker or the array. An answer
that is not such an array (text after it included) is content, as in vLLM.

Must not: read JSON itself (section.py's readers do).
"""

from __future__ import annotations

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.json_stream import skip_space
from octavo.entrypoints.server.tool_parsers.section import (
    PartialCall,
    SectionToolParser,
    read_call_array,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


@register_tool_parser("granite")
class GraniteToolParser(SectionToolParser):
    def split(self, text: str) -> tuple[int, bool]:
        first = skip_space(text, 0)
        after = _after_marker(text, first)
        if after is None:
            # Not an array, nor a marker: unless the answer so far may start one, content.
            rest = text[first:]
            maybe = any(marker.startswith(rest) for marker in MARKERS)
            return (0, False) if maybe else (len(text), False)
        if after == len(text):
            return 0, False  # the array may still follow
        if text.startswith("[", after):
            return first, True
        return len(text), False

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        after = _after_marker(section, skip_space(section, 0))
        assert after is not None
        return read_call_array(section, after, final)


def _after_marker(text: str, pos: int) -> int | None:
    """Where the array should start: past a marker at `pos` and whitespace (or `pos` if there
    is no marker and `[` is there); None when neither."""
    for marker in MARKERS:
        if text.startswith(marker, pos):
            return skip_space(text, pos + len(marker))
    return pos if text.startswith("[", pos) else None
