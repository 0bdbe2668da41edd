"""The Hermes / Qwen tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them, with free text around them (`--tool-call-parser hermes`).

Owns the reading of that markup, whole or streamed. The rules, the same in both modes:
- a block whose JSON is a call object becomes a tool call (its arguments are the raw text of
  the `arguments` value); a block that is not comes back as content, markup and all;
- an unclosed block at the end of the output is read as if it were closed;
- whitespace right before `<tool_call>` and right after `</tool_call>` is dropped, so text
  between calls does not turn into empty content;
- while streaming, text that may be the start of a tag is held back, so markup never reaches
  `content`.
One difference: a malformed block whose name and argument opening were already streamed
cannot be recalled; it ends as a truncated call (logged) instead of content.

Must not: depend on the tokenizer (tags are matched in text, whatever their token split).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from octavo.entrypoints.server.tool_parsers.base import (
    DeltaUpdate,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    make_tool_call_id,
    register_tool_parser,
)
from octavo.entrypoints.server.tool_parsers.json_stream import CallStreamer, parse_call
from octavo.entrypoints.server.tool_parsers.section import held_back

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0  # text before this index has been handled
        self._block: CallStreamer | None = None
        self._block_start = 0  # index just past the open block's START tag
        self._num_calls = 0
        self._pending_space = ""  # trailing whitespace of content, sent unless a call follows
        self._space_before_block = ""  # sent only if the open block turns out not to be a call
        self._after_call = False  # drop leading whitespace of the content that follows

    # --- whole answers ------------------------------------------------------------------------

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        after_call = False
        for match in _BLOCK.finditer(text):
            before = text[pos : match.start()]
            content.append(before.lstrip() if after_call else before)
            parsed = parse_call(match.group(1))
            if parsed is None:
                content.append(match.group(0))
                after_call = False
            else:
                content[-1] = content[-1].rstrip()
                calls.append(ParsedToolCall(make_tool_call_id(), *parsed))
                after_call = True
            pos = match.end()
        rest = text[pos:]
        content.append(rest.lstrip() if after_call else rest)
        return ExtractedToolCalls("".join(content) or None, calls)

    # --- streaming ----------------------------------------------------------------------------

    def feed(self, delta_text: str) -> DeltaUpdate:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaUpdate:
        update = self._advance(final=True)
        update.content += self._pending_space
        self._pending_space = ""
        return update

    def _advance(self, final: bool) -> DeltaUpdate:
        update = DeltaUpdate()
        text = self._text
        while True:
            if self._block is None:
                start = text.find(START, self._pos)
                if start == -1:
                    end = len(text) if final else len(text) - held_back(text[self._pos :], START)
                    self._content(text[self._pos : end], update, before_call=False)
                    # Forget handled text, so a long answer without calls costs linear time.
                    self._text, self._pos = text[end:], 0
                    return update
                self._content(text[self._pos : start], update, before_call=True)
                self._block = CallStreamer(self._num_calls)
                self._block_start = self._pos = start + len(START)
                continue
            end = text.find(END, self._block_start)
            if end == -1 and not final:
                body_end = len(text) - held_back(text[self._block_start :], END)
                update.tool_calls.extend(self._block.update(text[self._block_start : body_end]))
                return update
            body_end = len(text) if end == -1 else end
            block_end = len(text) if end == -1 else end + len(END)
            self._close_block(
                text[self._block_start : body_end],
                text[self._block_start - len(START) : block_end],
                update,
            )
            self._pos = block_end

    def _close_block(self, body: str, raw: str, update: DeltaUpdate) -> None:
        block, self._block = self._block, None
        assert block is not None
        deltas, valid = block.close(body)
        update.tool_calls.extend(deltas)
        if valid:
            self._num_calls += 1
            self._after_call = True
        elif block.started:
            self._num_calls += 1  # its index is taken: the client has seen it
            logger.warning("a streamed tool call turned out malformed: %r", raw[:200])
        else:
            update.content += self._space_before_block + raw
            self._after_call = False
        self._space_before_block = ""

    def _content(self, text: str, update: DeltaUpdate, before_call: bool) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_space + text
        kept = text.rstrip()
        self._pending_space = ""
        if before_call:
            self._space_before_block = text[len(kept) :]
        else:
            self._pending_space = text[len(kept) :]
        update.content += kept
