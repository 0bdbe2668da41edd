"""Parsers for outputs that structured outputs forced into a call (`tool_choice` set to a named
function or to "required").

Owns the reading of those two JSON shapes, whole or streamed:
- named function: the whole output is the arguments object of that one function;
- "required": the output is a non-empty array of `{"name": ..., "parameters": {...}}`, one
  item per call (the schema the request builder writes, as vLLM does).
The grammar guarantees the shape; should the output still not be one (the engine ran without
enforcement, or `max_tokens` cut it short), a whole answer comes back as content.

Must not: build the schemas (tool_choice.py does) or know about HTTP shapes.
"""

from __future__ import annotations

import json

from octavo.entrypoints.server.tool_parsers.base import (
    DeltaUpdate,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
    merge_updates,
)
from octavo.entrypoints.server.tool_parsers.json_stream import (
    CallStreamer,
    scan_object,
    skip_space,
)


class NamedToolParser(ToolParser):
    """The output is the arguments of `name`: one call, streamed as it is written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False
        self._pending_space = ""

    def extract(self, text: str) -> ExtractedToolCalls:
        arguments = text.strip()
        try:
            valid = isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        if not valid:
            return ExtractedToolCalls(text or None, [])
        return ExtractedToolCalls(None, [ParsedToolCall(make_tool_call_id(), self.name, arguments)])

    def feed(self, delta_text: str) -> DeltaUpdate:
        update = DeltaUpdate()
        text = self._pending_space + delta_text
        if not self._started:
            text = text.lstrip()
            if not text:
                return update
            self._started = True
            update.tool_calls.append(ToolCallDelta(0, make_tool_call_id(), self.name, ""))
        # Trailing whitespace waits: the non-streamed arguments are stripped.
        fragment = text.rstrip()
        self._pending_space = text[len(fragment) :]
        if fragment:
            update.tool_calls.append(ToolCallDelta(0, arguments=fragment))
        return update

    def finish(self) -> DeltaUpdate:
        return DeltaUpdate()


class RequiredToolsParser(ToolParser):
    """The output is a JSON array of `{"name", "parameters"}` objects; each becomes a call."""

    def __init__(self) -> None:
        self._text = ""
        # Where the reader is: before "[", before an item, in an item, after one, or done.
        self._state = "array"
        self._pos = 0  # the index the state refers to (item start while "item")
        self._streamer: CallStreamer | None = None
        self._num_calls = 0

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = RequiredToolsParser()
        merged = merge_updates([stream.feed(text), stream.finish()])
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        valid = (
            isinstance(value, list)
            and len(value) == len(merged.tool_calls) > 0
            and all(
                isinstance(item, dict) and set(item) == {"name", "parameters"} for item in value
            )
        )
        if not valid:
            return ExtractedToolCalls(text or None, [])
        return ExtractedToolCalls(None, merged.tool_calls)

    def feed(self, delta_text: str) -> DeltaUpdate:
        self._text += delta_text
        update = DeltaUpdate()
        text = self._text
        while self._state != "done":
            if self._state == "item":
                assert self._streamer is not None
                scan = scan_object(text, self._pos)
                if scan.end is None and not scan.malformed:
                    update.tool_calls.extend(self._streamer.update(text[self._pos :]))
                    return update
                if scan.end is None:
                    self._state = "done"  # not JSON: `extract` reports the answer as content
                    return update
                deltas, valid = self._streamer.close(text[self._pos : scan.end])
                update.tool_calls.extend(deltas)
                if valid or self._streamer.started:
                    self._num_calls += 1
                self._streamer = None
                self._state, self._pos = "after", scan.end
                continue
            pos = skip_space(text, self._pos)
            if pos >= len(text):
                return update
            expected = {"array": "[", "before": "{", "after": ","}[self._state]
            if text[pos] != expected:
                self._state = "done"  # "]" or not the expected shape: nothing more to stream
            elif self._state == "before":
                self._streamer = CallStreamer(self._num_calls, args_key="parameters")
                self._state, self._pos = "item", pos
            else:
                self._state, self._pos = "before", pos + 1
        return update

    def finish(self) -> DeltaUpdate:
        return DeltaUpdate()
