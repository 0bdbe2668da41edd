"""The tool-parser interface: model text -> OpenAI tool calls, whole or as stream deltas.

Owns `ToolParser` (one instance per choice of one request), the plain-data results it returns
(`ExtractedToolCalls` for a finished answer, `DeltaUpdate` per streamed text delta), the
registry that `--tool-call-parser NAME` looks up, and tool-call ids.

Must not: know about HTTP or pydantic shapes (the chat handler converts), or raise on what the
model wrote: text that is not a well-formed call comes back as content.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    id: str
    name: str
    # The arguments as JSON text, exactly as the model wrote the value.
    arguments: str


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A finished answer split into what the user reads and the calls the model made."""

    content: str | None
    tool_calls: list[ParsedToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of one call in OpenAI's stream shape: the first delta of call `index` carries
    `id` and `name` (and arguments ""), later ones only argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class DeltaUpdate:
    """What one text delta means for the client: new content and call pieces (both may be
    empty while the parser holds back text that may be the start of a markup tag)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: DeltaUpdate) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ToolParser(ABC):
    """Reads one choice's output. Streaming: `feed` each text delta in order, then `finish`
    once. The deltas of one stream, concatenated, give the same content and calls as
    `extract` on the whole text (for well-formed calls). An instance serves one choice only.

    `tools` are the request's tools as the chat template takes them (`{"type": "function",
    "function": {...}}`); formats that write arguments as text read their types there."""

    # The format's markers are special tokens, which the output must keep: a request this
    # parser reads is decoded with skip_special_tokens off (as vLLM does for `mistral`).
    keeps_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole answer -> content and calls. Never raises on model text."""

    @abstractmethod
    def feed(self, delta_text: str) -> DeltaUpdate:
        """Consume the next text delta; returns what can be sent now. Text that may still turn
        out to be markup is held back until later deltas (or `finish`) decide."""

    @abstractmethod
    def finish(self) -> DeltaUpdate:
        """The output has ended: flush what was held back (an unclosed call is closed)."""


def merge_updates(updates: Iterable[DeltaUpdate]) -> ExtractedToolCalls:
    """Reassemble stream deltas as a client does: content concatenated, each call's id and name
    from its first delta, argument fragments concatenated."""
    content = ""
    calls: dict[int, list[str]] = {}
    for update in updates:
        content += update.content
        for delta in update.tool_calls:
            call = calls.setdefault(delta.index, ["", "", ""])
            call[0] = delta.id or call[0]
            call[1] = delta.name or call[1]
            call[2] += delta.arguments or ""
    return ExtractedToolCalls(
        content or None,
        [ParsedToolCall(*calls[index]) for index in sorted(calls)],
    )


# --- registry ---------------------------------------------------------------------------------

_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming tool_call_parser otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(tool_parser_names())}; got {name!r}."
        ) from None
