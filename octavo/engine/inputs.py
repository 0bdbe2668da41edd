"""The prompt forms callers give the engine, as vLLM types them (`octavo.inputs` re-exports
them): plain text, a list of token ids, or a dict naming which of the two it holds.

Data types only: no tokenizer, no torch, so that `import octavo` stays light. Checking and
tokenizing a prompt is the InputProcessor's job.
"""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt the engine tokenizes (with the tokenizer's special tokens, BOS included)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids, run as they are (no special tokens added)."""

    prompt_token_ids: list[int]


# One prompt of `generate`: text, token ids, or either as its dict.
PromptType = str | list[int] | TextPrompt | TokensPrompt
