"""Incremental detokenization and stop strings for one request's output stream.

Owns: turning a request's output token ids into text a few tokens at a time, finding stop
strings in that text, and the hold-back rules that make streamed text final (a client never
receives a broken character or the start of a stop string that is later cut off).

Must not: know about output kinds, logprobs, `n > 1`, the scheduler or the model; import torch.
The output processor drives one `Detokenizer` per request and decides what to send.

Why not `tokenizers.decoders.DecodeStream`: it implements the same windowed method, but it
cannot flush the tokens it holds back when a request ends in the middle of a character (the
final text would then differ from `tokenizer.decode`), it raises on a prefix change instead of
degrading, and its window is hidden, so special-token spacing cannot be layered on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from octavo.core.sampling_params import SamplingParams

# Lossy UTF-8 decoding ends a string with this while a character's bytes are incomplete.
_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output: decoders such as Metaspace drop the leading
# space of the first token they see, so the first output token needs a predecessor. A few
# tokens also cover a character whose bytes span the last prompt tokens.
_PROMPT_CONTEXT_TOKENS = 4
_MAX_PROMPT_CONTEXT_TOKENS = 16


def get_backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the argument itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class IncrementalDecoder:
    """Token ids in, text out, O(new tokens) per call (vLLM's prefix/read offset method).

    Only a short window of ids is decoded each time. Text is emitted once decoding the window
    no longer ends in U+FFFD, so a character split over several tokens comes out whole:

        ... earlier tokens | context (emitted) | unread (held back) |
                           ^ window[0]         ^ _read_idx          ^ newest token

    `_prefix_text` is the decoding of the context; the new text is what decoding the whole
    window adds to it. After an emission the unread tokens become the next context.
    """

    __slots__ = (
        "_added_tokens",
        "_last_was_added",
        "_prefix_text",
        "_read_idx",
        "_skip_special_tokens",
        "_tokenizer",
        "_window",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = _prompt_context(tokenizer, prompt_token_ids)
        self._read_idx = len(self._window)
        self._prefix_text = self._decode(self._window)
        # Only visible added tokens can be adjacent in the text; fast tokenizers never insert
        # spaces themselves, so the flag can only remove the ones a decoder (WordPiece) adds.
        self._added_tokens: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added_tokens = {
                token_id: added.content
                for token_id, added in tokenizer.get_added_tokens_decoder().items()
            }
        self._last_was_added = bool(self._window) and self._window[-1] in self._added_tokens

    def decode_next(self, token_id: int) -> str:
        """Appends one token; returns the text it completes ("" while a character is partial)."""
        nothing_pending = self._read_idx == len(self._window)
        self._window.append(token_id)
        content = self._added_tokens.get(token_id)
        after_added, self._last_was_added = self._last_was_added, content is not None
        if content is not None and after_added and nothing_pending:
            # Emit the token alone, without the separator the decoder would put before it,
            # and restart the window on it so later text is decoded after the raw content.
            self._window = [token_id]
            self._read_idx = 1
            self._prefix_text = self._decode(self._window)
            return content
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Text of the held-back tokens, U+FFFD included: the output ended mid-character."""
        if self._read_idx == len(self._window):
            return ""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            # Only skipped special tokens were pending.
            self._read_idx = len(self._window)
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        # The window and its context start at a character boundary (the previous emission
        # ended on a complete character), so `text` starts with `_prefix_text`.
        new_text = text[len(self._prefix_text) :]
        del self._window[: self._read_idx]
        self._read_idx = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The last few prompt tokens, starting where decoding does not begin mid-character."""
    num_prompt_tokens = len(prompt_token_ids)
    smallest = min(num_prompt_tokens, _PROMPT_CONTEXT_TOKENS)
    for size in range(smallest, min(num_prompt_tokens, _MAX_PROMPT_CONTEXT_TOKENS) + 1):
        context = prompt_token_ids[num_prompt_tokens - size :]
        if not tokenizer.decode(context, skip_special_tokens=False).startswith(_REPLACEMENT_CHAR):
            return list(context)
    return list(prompt_token_ids[num_prompt_tokens - smallest :])


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The earliest stop string that ends in the last `num_new_chars` of `text`.

    Returns (stop string, length the text is cut to), or None. Matches that end before the new
    characters were looked for when those characters arrived, so they are not searched again.
    """
    best: tuple[str, int] | None = None
    best_idx = len(text)
    for stop_str in stop:
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        idx = text.find(stop_str, start)
        if idx != -1 and idx < best_idx:
            best_idx = idx
            cut = idx + len(stop_str) if include_stop_str_in_output else idx
            best = (stop_str, cut)
    return best


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    # How many of the new tokens belong to the output; tokens after a stop string are dropped.
    num_kept_tokens: int
    # The stop string found in this update, if any (the request is then finished).
    stop_string: str | None


class Detokenizer:
    """One request's output text: incremental decoding plus stop strings and hold-back.

    `text` is the output so far, already cut at a stop string. While the request runs only
    `text[:num_output_chars]` may be sent: the last `max(len(stop)) - 1` characters are held
    back, since a later token may complete a stop string that starts in them and they would be
    cut. `finish()` releases them and any bytes of an incomplete character.
    """

    __slots__ = (
        "_decoder",
        "_include_stop_str",
        "_min_tokens",
        "_stop",
        "_stop_buffer_len",
        "is_finished",
        "num_tokens",
        "text",
    )

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        self._decoder = IncrementalDecoder(
            tokenizer,
            prompt_token_ids,
            sampling_params.skip_special_tokens,
            sampling_params.spaces_between_special_tokens,
        )
        self._stop: list[str] = list(sampling_params.stop or [])
        self._include_stop_str = sampling_params.include_stop_str_in_output
        self._min_tokens = sampling_params.min_tokens
        # With include_stop_str_in_output the cut is after the stop string, so text before it
        # is never removed and nothing needs holding back.
        self._stop_buffer_len = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop_str else 0
        )
        self.text = ""
        self.num_tokens = 0
        self.is_finished = False

    @property
    def num_output_chars(self) -> int:
        """How much of `text` is final and may be sent to a streaming client."""
        if self.is_finished:
            return len(self.text)
        return max(0, len(self.text) - self._stop_buffer_len)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> DetokenizerUpdate:
        """Decodes a step's new tokens and looks for stop strings after each one.

        `stop_terminated`: the last token is the EOS or a stop token id that ended the request;
        its text is left out unless include_stop_str_in_output (vLLM). Stop strings count only
        once more than `min_tokens` tokens were generated. Does not finish the detokenizer.
        """
        num_new_tokens = len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            self.num_tokens += 1
            if stop_terminated and i == num_new_tokens - 1 and not self._include_stop_str:
                break
            new_text = self._decoder.decode_next(token_id)
            if not new_text:
                continue
            self.text += new_text
            if not self._stop or self.num_tokens <= self._min_tokens:
                continue
            found = find_stop_string(self.text, len(new_text), self._stop, self._include_stop_str)
            if found is not None:
                stop_string, cut = found
                self.text = self.text[:cut]
                return DetokenizerUpdate(i + 1, stop_string)
        return DetokenizerUpdate(num_new_tokens, None)

    def finish(self) -> None:
        """Ends the output: flushes an incomplete character's bytes (as U+FFFD) and makes all of
        `text` sendable. Idempotent. After a stop string nothing is pending: the token that
        completed it was just decoded and the tokens after it were never fed."""
        if not self.is_finished:
            self.text += self._decoder.flush()
            self.is_finished = True
