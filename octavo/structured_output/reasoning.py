"""A constraint that waits for the thinking to end: with `--reasoning-parser`, an output
constraint (response_format, structured_outputs, a forced tool call) holds over the answer
only, as vLLM applies it.

Owns `ReasoningGate` (the parser's markers, core/reasoning.py, as token ids of one tokenizer,
and vLLM's rule for whether a prompt leaves the model thinking) and
`ThinkingGatedGrammar` (a request's grammar that lets every token through until the model
writes the end marker, then constrains the rest).

The gate works on token ids: a tokenizer whose markers are not single tokens has none, and the
server then refuses constraints while a reasoning parser is on (a 400 naming the field).
Must not: know about HTTP or the text-level parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from octavo.core.reasoning import REASONING_MARKERS
from octavo.structured_output.grammar import GuidanceGrammar


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    start_token_id: int
    end_token_id: int

    @classmethod
    def for_tokenizer(
        cls, reasoning_parser: str | None, tokenizer: PreTrainedTokenizerBase
    ) -> ReasoningGate | None:
        """The parser's markers as this tokenizer's token ids; None without a parser or when
        a marker is not one token of the vocabulary."""
        if reasoning_parser is None:
            return None
        if reasoning_parser not in REASONING_MARKERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_MARKERS)}; got "
                f"{reasoning_parser!r}."
            )
        vocab = tokenizer.get_vocab()
        start, end = REASONING_MARKERS[reasoning_parser]
        if start not in vocab or end not in vocab:
            return None
        return cls(vocab[start], vocab[end])

    def is_thinking_after(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the model starts its output inside the thinking (vLLM's rule): the last
        marker in the prompt is not an end one. Templates that turn thinking off write an
        empty `<think></think>` into the prompt; those that open it write `<think>`."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_token_id:
                return False
            if token_id == self.start_token_id:
                return True
        return True

    def gate(self, grammar: GuidanceGrammar) -> ThinkingGatedGrammar:
        return ThinkingGatedGrammar(grammar, self.end_token_id)


class ThinkingGatedGrammar:
    """Implements octavo.core.request.RequestGrammar: every token is allowed (and none is fed
    to the grammar) up to and including the end-of-thinking token; the grammar constrains
    the tokens after it."""

    __slots__ = ("end_token_id", "grammar", "thinking")

    def __init__(self, grammar: GuidanceGrammar, end_token_id: int) -> None:
        self.grammar = grammar
        self.end_token_id = end_token_id
        self.thinking = True

    def is_ready(self) -> bool:
        return self.grammar.is_ready()

    def accept_token(self, token_id: int) -> bool:
        if self.thinking:
            self.thinking = token_id != self.end_token_id
            return True
        return self.grammar.accept_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        """While thinking, the tokens before the end-of-thinking one (a proposal stops short of
        it, so that every position it adds is still inside the thinking, unconstrained)."""
        if not self.thinking:
            return self.grammar.num_valid(token_ids)
        return (
            token_ids.index(self.end_token_id) if self.end_token_id in token_ids else len(token_ids)
        )

    def is_terminated(self) -> bool:
        return not self.thinking and self.grammar.is_terminated()

    def error(self) -> str | None:
        return None if self.thinking else self.grammar.error()
