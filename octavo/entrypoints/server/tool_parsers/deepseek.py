# ruff: noqa: RUF001, RUF002 (DeepSeek's markers are written with fullwidth bars)
"""DeepSeek-V3's tool-call format (`--tool-call-parser deepseek_v3`): content, then

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with one `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` per call.

Owns that reading: the arguments are the text of the fenced block, which must be a JSON
object. Text after `<｜tool▁calls▁end｜>` is dropped, as vLLM drops it.

Must not: depend on the tokenizer (the markers are matched in text).
"""

from __future__ import annotations

import json

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.section import (
    PartialCall,
    SectionToolParser,
    held_back,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(SectionToolParser):
    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(CALLS_BEGIN)
        if start != -1:
            return start, True
        return len(text) - held_back(text, CALLS_BEGIN), False

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        section = section.split(CALLS_END, 1)[0]
        calls = []
        pieces = section.split(CALL_BEGIN)[1:]
        for number, piece in enumerate(pieces):
            complete = final or number < len(pieces) - 1 or CALL_END in piece
            call = _read_call(piece.split(CALL_END, 1)[0], complete)
            if call is None:
                return None if complete else calls
            calls.append(call)
        return calls


def _read_call(text: str, complete: bool) -> PartialCall | None:
    """`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` -> the call so far, or None (not
    one when `complete`, nothing to send yet otherwise)."""
    sep = text.find(SEP)
    newline = text.find("\n", sep + len(SEP)) if sep != -1 else -1
    if newline == -1:
        return None
    name = text[sep + len(SEP) : newline].strip()
    if not name:
        return None
    rest = text[newline + 1 :]
    if not rest.startswith(FENCE_OPEN):
        if complete or not FENCE_OPEN.startswith(rest):
            return None
        return PartialCall(name, "")
    arguments = rest[len(FENCE_OPEN) :]
    close = arguments.find(FENCE_CLOSE)
    if close != -1:
        arguments = arguments[:close]
    elif not complete:
        return PartialCall(name, arguments[: len(arguments) - held_back(arguments, FENCE_CLOSE)])
    try:
        valid = isinstance(json.loads(arguments), dict)
    except ValueError:
        valid = False
    return PartialCall(name, arguments) if valid else None
