"""Reasoning on /v1/chat/completions: the model's thinking split from its answer
(`--reasoning-parser NAME`, vLLM's names).

Owns `ReasoningParser` (one instance per choice of one request: thinking and answer, whole or
as stream deltas) and the names `--reasoning-parser` takes:
- `deepseek_r1`: the output starts inside the thinking (DeepSeek-R1's template opens
  `<think>` in the prompt); everything before `</think>` is thinking, a `<think>` the model
  writes itself before it is dropped; an output that never closes is all thinking;
- `qwen3`: as vLLM 0.32's, the output starts inside the thinking too (newer Qwen3 templates
  open `<think>` in the prompt; a `<think>` the model writes is dropped), and the thinking
  also ends where a `<tool_call>` starts (the call is answer, for the tool parser);
  `chat_template_kwargs.enable_thinking: false` turns the parser off for that request, so all
  of the output is answer.

The chat handler sends the thinking as `reasoning` and hands only the answer to the tool
parser, so calls are read after the thinking ends (vLLM's order).

Must not: know about HTTP or pydantic shapes, or raise on what the model wrote.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from octavo.structured_output.reasoning import REASONING_MARKERS, THINK_END, THINK_START


@dataclass(slots=True)
class ReasoningDelta:
    """What one text delta adds to the thinking and to the answer (both may be empty while
    the parser holds back text that may be the start of a tag)."""

    reasoning: str = ""
    content: str = ""

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class _Phase(enum.Enum):
    BEFORE = enum.auto()  # no thinking yet: answer text, `<think>` may open it
    THINKING = enum.auto()
    ANSWER = enum.auto()  # the thinking has ended: all the rest is answer


class ReasoningParser:
    """Reads one choice's output. Streaming: `feed` each text delta in order, then `finish`
    once; the deltas' thinking and answer pieces, joined, equal `extract` of the whole text
    whatever the chunking (a tag split across deltas is held back until it is whole)."""

    # Whether the output starts inside the thinking (the template opened `<think>`).
    starts_in_thinking = False
    # Text that ends the thinking without `</think>` and itself belongs to the answer.
    implicit_ends: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.phase = _Phase.THINKING if self.starts_in_thinking else _Phase.BEFORE
        # Whether `<think>` has been read (or, starting inside, may still be dropped).
        self.opened = not self.starts_in_thinking
        self.held = ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """The whole output -> (thinking, answer); None for an empty part."""
        result = self.feed(text)
        result.extend(self.finish())
        return result.reasoning or None, result.content or None

    def feed(self, delta_text: str) -> ReasoningDelta:
        result = ReasoningDelta()
        self.held += delta_text
        while self.held:
            if self.phase is _Phase.ANSWER:
                result.content += self.held
                self.held = ""
                break
            markers = self._markers()
            found = [(self.held.find(m), m) for m in markers if m in self.held]
            if not found:
                keep = _partial_suffix(self.held, markers)
                self._emit(result, self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            index, marker = min(found)
            self._emit(result, self.held[:index])
            if marker in self.implicit_ends:  # the answer starts with it
                self.held = self.held[index:]
                self.phase = _Phase.ANSWER
                continue
            self.held = self.held[index + len(marker) :]
            self.opened = True
            self.phase = _Phase.THINKING if marker == THINK_START else _Phase.ANSWER
        return result

    def finish(self) -> ReasoningDelta:
        """The output has ended: what was held back goes where it was."""
        result = ReasoningDelta()
        self._emit(result, self.held)
        self.held = ""
        return result

    def _markers(self) -> tuple[str, ...]:
        if self.phase is _Phase.BEFORE:
            return (THINK_START,)
        ends = (THINK_END, *self.implicit_ends)
        return ends if self.opened else (*ends, THINK_START)

    def _emit(self, result: ReasoningDelta, text: str) -> None:
        if self.phase is _Phase.THINKING:
            result.reasoning += text
        else:
            result.content += text


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_thinking = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_thinking = True
    implicit_ends = ("<tool_call>",)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of a marker."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


# --- registry ---------------------------------------------------------------------------------

_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
assert set(_PARSERS) == set(REASONING_MARKERS), "one list of parser names"
# Parsers a request turns off with `chat_template_kwargs: {"enable_thinking": false}`.
_SWITCHABLE = {"qwen3"}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class named `name`; ValueError naming reasoning_parser otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(reasoning_parser_names())}; got {name!r}."
        ) from None


def reasoning_parser_for(
    name: str | None, chat_template_kwargs: Mapping[str, Any]
) -> Callable[[], ReasoningParser] | None:
    """What makes one parser per choice for a request rendered with these template kwargs;
    None where its output is all answer (no parser, or thinking turned off)."""
    if name is None:
        return None
    if name in _SWITCHABLE and chat_template_kwargs.get("enable_thinking", True) is False:
        return None
    return get_reasoning_parser(name)
