"""The shared reading of formats whose calls form one section at the end of the output:
content first, then a marker (or the opening bracket of a call list), then the calls.

Owns `SectionToolParser`. A format says two things: where its section starts (`split`), and
what calls the section holds so far (`read_calls`, called again on the whole section as it
grows). This class turns that into both answers:
- whole: the content before the section (trailing whitespace dropped) and the calls; a
  section that holds no well-formed call leaves the whole text as content;
- streamed: the content as it comes (text that may still be the start of the section held
  back), each call's id and name once its name is complete, then argument fragments, each
  the part of the call's argument text that `read_calls` had not reported before.
The rule that makes the two agree: the argument text `read_calls` reports for a call while
the section grows is always a prefix of the text it reports once the output is complete. A
format breaks it only on output that is not a well-formed call; a streamed call that turns
out malformed cannot be recalled and ends as it was sent (logged), as in hermes.py.

Also owns the JSON readers that several formats share (`read_json_call`, `read_json_calls`,
`read_call_array`).

Must not: know one format's markup (the format modules do) or HTTP shapes.
"""

from __future__ import annotations

import json
import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from octavo.entrypoints.server.tool_parsers.base import (
    DeltaUpdate,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
)
from octavo.entrypoints.server.tool_parsers.json_stream import scan_object, skip_space

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PartialCall:
    """One call as far as it is written: its complete name, and its argument text so far (a
    prefix of the final text; the final text once the output is complete)."""

    name: str
    arguments: str


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class SectionToolParser(ToolParser):
    """Content, then a section of calls to the end of the output. Subclasses give `split`
    and `read_calls`; `make_id` when the format's ids differ from the default."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._num_content_sent = 0  # text[:this] has gone out as content (or was dropped)
        self._section_start: int | None = None
        self._plain = False  # the section turned out not to be calls: the rest is content
        self._done = False  # a streamed call turned out malformed: nothing more is sent
        self._sent: list[tuple[str, str]] = []  # per call: the name and arguments sent

    @abstractmethod
    def split(self, text: str) -> tuple[int, bool]:
        """Where the section starts in `text` (the whole output so far): `(index, True)` when
        it starts at `index`; `(index, False)` when no section has started yet and
        `text[index:]` may still turn out to be the start of one (held back while streaming;
        content once the output is complete)."""

    @abstractmethod
    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        """The calls in `section` (the text from the section's start), in order, each only
        once its name is complete; None when `section` is not (or can no longer become)
        well-formed calls. `final`: the output is complete."""

    def make_id(self) -> str:
        return make_tool_call_id()

    # --- whole answers ------------------------------------------------------------------------

    def extract(self, text: str) -> ExtractedToolCalls:
        start, found = self.split(text)
        calls = self.read_calls(text[start:], final=True) if found else None
        if not calls:
            return ExtractedToolCalls(text or None, [])
        content = text[:start].rstrip() or None
        return ExtractedToolCalls(
            content, [ParsedToolCall(self.make_id(), c.name, c.arguments) for c in calls]
        )

    # --- streaming ----------------------------------------------------------------------------

    def feed(self, delta_text: str) -> DeltaUpdate:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaUpdate:
        return self._advance(final=True)

    def _advance(self, final: bool) -> DeltaUpdate:
        update = DeltaUpdate()
        if self._done:
            return update
        if self._plain:
            self._send_content(len(self._text), update, keep_space=True)
            return update
        if self._section_start is None:
            start, found = self.split(self._text)
            if not found:
                end = len(self._text) if final else start
                self._send_content(end, update, keep_space=final)
                return update
            self._send_content(start, update, keep_space=False)
            self._section_start = start
        calls = self.read_calls(self._text[self._section_start :], final)
        if calls is None or (final and not calls):
            self._not_calls(update)
            return update
        for index, call in enumerate(calls):
            self._send_call(index, call, update)
        return update

    def _send_content(self, end: int, update: DeltaUpdate, keep_space: bool) -> None:
        # Trailing whitespace waits: it is dropped if a section follows.
        if not keep_space:
            end = len(self._text[:end].rstrip())
        if end > self._num_content_sent:
            update.content += self._text[self._num_content_sent : end]
            self._num_content_sent = end

    def _not_calls(self, update: DeltaUpdate) -> None:
        if self._sent:
            self._done = True
            logger.warning("a streamed tool call turned out malformed: %r", self._text[-200:])
            return
        # Nothing was sent of the section: it all becomes content, held whitespace included.
        self._plain = True
        self._send_content(len(self._text), update, keep_space=True)

    def _send_call(self, index: int, call: PartialCall, update: DeltaUpdate) -> None:
        if index == len(self._sent):
            self._sent.append((call.name, ""))
            update.tool_calls.append(ToolCallDelta(index, self.make_id(), call.name, ""))
        name, arguments = self._sent[index]
        if call.name != name or not call.arguments.startswith(arguments):
            # The format broke its prefix rule (malformed output): nothing more for this call.
            logger.warning("tool call %d changed after it was streamed: %r", index, call)
            return
        fragment = call.arguments[len(arguments) :]
        if fragment:
            self._sent[index] = (name, call.arguments)
            update.tool_calls.append(ToolCallDelta(index, arguments=fragment))


# --- JSON call objects --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JsonCallRead:
    """A call object read from `pos`: `call` once its name is complete and its arguments
    object has opened (else None); `end` just past the object once it is complete."""

    call: PartialCall | None
    end: int | None


def read_json_call(text: str, pos: int, args_keys: tuple[str, ...]) -> JsonCallRead | None:
    """The `{"name": ..., <one of args_keys>: {...}}` object at `pos` (whitespace first is
    skipped), or None when it is not (or can no longer become) one. The argument text is the
    raw text of the value, as the model wrote it."""
    scan = scan_object(text, pos)
    if scan.malformed:
        return None
    if scan.end is not None:
        try:
            value = json.loads(text[pos : scan.end])
        except ValueError:
            return None
        key = next((key for key in args_keys if key in value), None)
        name = value.get("name")
        if not isinstance(name, str) or not name or key is None:
            return None
        if not isinstance(value[key], dict):
            return None
        args_start, args_end = scan.members[key]
        return JsonCallRead(PartialCall(name, text[args_start:args_end]), scan.end)
    name_span = scan.members.get("name")
    name = json.loads(text[name_span[0] : name_span[1]]) if name_span else None
    if name_span is not None and (not isinstance(name, str) or not name):
        return None
    key = next((k for k in args_keys if k in scan.members or scan.open_key == k), None)
    if key in scan.members:
        args_start, args_end = scan.members[key]
    elif key is not None and scan.open_start is not None:
        args_start, args_end = scan.open_start, len(text)
    else:
        return JsonCallRead(None, None)
    if text[args_start] != "{":
        return None  # only an object can be arguments
    if name is None:
        return JsonCallRead(None, None)
    return JsonCallRead(PartialCall(name, text[args_start:args_end]), None)


def read_json_calls(
    text: str, pos: int, final: bool, args_keys: tuple[str, ...]
) -> tuple[list[PartialCall], int | None] | None:
    """A JSON array of call objects starting at `pos` (after whitespace): the calls so far
    and the index just past the closing bracket (None while open); None when the text is not
    (or can no longer become) such an array. An unclosed array is malformed when `final`."""
    pos = skip_space(text, pos)
    if pos >= len(text):
        return None if final else ([], None)
    if text[pos] != "[":
        return None
    calls: list[PartialCall] = []
    pos = skip_space(text, pos + 1)
    expect_item = True  # after "[" or ","
    while pos < len(text):
        if text[pos] == "]" and (not expect_item or not calls):
            return calls, pos + 1
        if not expect_item:
            if text[pos] != ",":
                return None
            pos = skip_space(text, pos + 1)
            expect_item = True
            continue
        read = read_json_call(text, pos, args_keys)
        if read is None:
            return None
        if read.end is None:
            if final:
                return None
            if read.call is not None:
                calls.append(read.call)
            return calls, None
        assert read.call is not None
        calls.append(read.call)
        pos = skip_space(text, read.end)
        expect_item = False
    return None if final else (calls, None)


def read_call_array(text: str, pos: int, final: bool) -> list[PartialCall] | None:
    """The calls of a JSON array of {"name", "arguments"} objects at `pos` that ends the text
    (read_json_calls); None where it is not one, or text follows its closing bracket."""
    read = read_json_calls(text, pos, final, ("arguments",))
    if read is None:
        return None
    calls, end = read
    if end is not None and text[end:].strip():
        return None  # text after the array: not the format
    return calls
