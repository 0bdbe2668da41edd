"""Mistral's tool-call format (`--tool-call-parser mistral`): content, then `[TOOL_CALLS]`
and the calls, written one of two ways by the model's tokenizer version:
- before v11: one JSON array of `{"name": ..., "arguments": {...}}` objects;
- v11 and later: `name{...}` per call, each after its own `[TOOL_CALLS]`; an `[ARGS]` (and
  a `[CALL_ID]id`) between the name and the arguments is read too.

Owns that reading, and Mistral's tool-call ids (9 letters and digits, what Mistral's own
validation asks for). `[TOOL_CALLS]` is a special token, so requests read by this parser
keep special tokens in their text (vLLM does the same).

Must not: read JSON itself (section.py's readers do).
"""

from __future__ import annotations

import random
import re
import string

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.json_stream import decode_value, skip_space
from octavo.entrypoints.server.tool_parsers.section import (
    PartialCall,
    SectionToolParser,
    held_back,
    read_call_array,
)

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
# What may stand between `[TOOL_CALLS]` and the arguments' "{" in the v11 form.
_HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*")


def make_mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


@register_tool_parser("mistral")
class MistralToolParser(SectionToolParser):
    keeps_special_tokens = True

    def make_id(self) -> str:
        return make_mistral_tool_call_id()

    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(TOOL_CALLS)
        if start != -1:
            return start, True
        return len(text) - held_back(text, TOOL_CALLS), False

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        body = skip_space(section, len(TOOL_CALLS))
        if body == len(section) and not final:
            return []
        if section.startswith("[", body) and not section.startswith("[ARGS]", body):
            return read_call_array(section, body, final)
        calls = []
        pieces = section.split(TOOL_CALLS)[1:]
        for number, piece in enumerate(pieces):
            call = _read_named_call(piece, final or number < len(pieces) - 1)
            if call is None:
                return None
            if call is not _UNFINISHED:
                calls.append(call)
            if call is _UNFINISHED or not call.arguments.endswith("}"):
                break
        return calls


_UNFINISHED = PartialCall("", "")


def _read_named_call(piece: str, complete: bool) -> PartialCall | None:
    """One `name[ARGS]{...}` piece: the call, _UNFINISHED while its name is being written,
    or None when it is not one. `complete`: nothing more will be added to the piece."""
    brace = piece.find("{")
    if brace == -1:
        return None if complete else _UNFINISHED
    head = _HEAD.fullmatch(piece, 0, brace)
    if head is None:
        return None
    name = head.group(1)
    try:
        decoded = decode_value(piece, brace)
    except ValueError:
        return None
    if decoded is None:
        if complete:
            return None
        return PartialCall(name, piece[brace:])
    value, end = decoded
    rest = piece[end:].strip()
    if not isinstance(value, dict) or (rest and (complete or not TOOL_CALLS.startswith(rest))):
        return None
    return PartialCall(name, piece[brace:end])
