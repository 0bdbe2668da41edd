"""GuidanceBackend: StructuredOutputsParams -> llguidance grammars, matchers and token masks.

Owns the one `LLTokenizer` built from the engine's Hugging Face tokenizer (about half a second,
so once per engine, and only when a first structured request arrives), the translation of each
constraint kind into an llguidance grammar, the cheap validity check that turns a bad schema,
regex or grammar into a ValueError before admission, and the batched mask fill.

Must not: know about requests, scheduling or threads (the manager decides when and where to
compile); touch torch (masks are numpy int32, applied by the sampler's op).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from transformers import PreTrainedTokenizerBase

from octavo.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON layout the grammar enforces unless a schema's "x-guidance" says otherwise: Python's
# json.dumps separators and no free whitespace. Free whitespace lets a small model emit
# newlines forever inside a valid object; fixed separators keep outputs short and the same.
_JSON_DEFAULTS: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    # `oneOf` whose branches cannot be proved disjoint is treated as `anyOf` instead of
    # rejected: the output still validates whenever exactly one branch matches it.
    "coerce_one_of": True,
}
# A grammar the library parses into a matcher in its error state: the stand-in when building
# a matcher fails unexpectedly after validation, so the request ends instead of the engine.
_FAILED_GRAMMAR = "%failed%"
# The most alternatives the library's parser keeps in one row (its default ParserLimits): a
# longer choice list compiles, then fails at its first tokens.
MAX_CHOICES = 2000


class GuidanceBackend:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        """`vocab_size` is the model's (the logits' width). Ids the tokenizer does not have are
        never allowed; EOS (any of `eos_token_ids`) is allowed exactly where a grammar may end."""
        eos = list(eos_token_ids) or tokenizer.eos_token_id
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos
            )
        except Exception as exc:  # slow tokenizers, odd vocabularies: one clear message
            raise ValueError(
                f"structured_outputs is not supported with this model's tokenizer: {exc}"
            ) from exc
        self.vocab_size = self.tokenizer.vocab_size
        self.executor = llguidance.LLExecutor()

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a token mask."""
        return (self.vocab_size + 31) // 32

    # --- grammars ---------------------------------------------------------------------------

    def grammar_spec(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for `params`. Raises ValueError naming the field when the
        input cannot even be read (a JSON schema that is not JSON, a grammar that is neither
        Lark nor GBNF); deeper errors are left to `validate`."""
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_DEFAULTS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, _JSON_DEFAULTS
                )
            if kind == "regex":
                # `\d` means [0-9], as users expect, not any Unicode digit (Rust's and
                # Python's default): a small model will otherwise pick exotic digits.
                lark_regex = llguidance.regex_to_lark(params.regex or "", "d")
                return llguidance.LLMatcher.grammar_from_lark(f"start: /{lark_regex}/")
            if kind == "choice":
                if len(params.choice or ()) > MAX_CHOICES:
                    raise ValueError(
                        f"{len(params.choice)} choices; the grammar engine follows at most "
                        f"{MAX_CHOICES}"
                    )
                return llguidance.grammar_from("choice", json.dumps(params.choice))
            return llguidance.grammar_from("grammar", params.grammar or "")
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{kind} is invalid: {exc}") from None

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar for `params` once the library accepts it. Raises ValueError naming
        `structured_outputs.<kind>` and the library's reason otherwise. Cheap (milliseconds):
        it parses and checks; the token-level automaton is built later, lazily."""
        spec = self.grammar_spec(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            spec, self.tokenizer
        )
        if is_error:
            reason = messages[0].strip() if messages else "rejected"
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {reason}")
        for message in messages:
            logger.debug("structured_outputs.%s: %s", params.kind, message)
        return spec

    def compile_checked(self, params: StructuredOutputsParams, spec: str) -> llguidance.LLMatcher:
        """A matcher for a validated grammar, refused if it cannot be followed: the library
        puts it in its error state (an unsatisfiable regex, a grammar past its limits), or
        its first mask allows no token at all. Raises ValueError naming the field."""
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, spec, log_level=0)
            first = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, first, 0)
        except Exception as exc:  # the library's own failure, as the client's 400
            raise ValueError(
                f"structured_outputs.{params.kind} cannot be compiled: {exc}"
            ) from None
        if matcher.is_error():
            raise ValueError(
                f"structured_outputs.{params.kind} cannot be followed by any output: "
                f"{matcher.get_error().splitlines()[0]}"
            )
        if not first.any():
            raise ValueError(f"structured_outputs.{params.kind} allows no output at all.")
        return matcher

    def compile(self, spec: str) -> llguidance.LLMatcher:
        """A fresh matcher for a validated grammar, its lexer already built (the first mask is
        the slow one: milliseconds to seconds by grammar). Requests get deep copies of it."""
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, spec, log_level=0)
            scratch = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, scratch, 0)
        except Exception:
            logger.exception("building a structured-output matcher failed")
            matcher = llguidance.LLMatcher(self.tokenizer, _FAILED_GRAMMAR, log_level=0)
        if matcher.is_error():
            logger.error("structured-output grammar failed: %s", matcher.get_error())
        return matcher

    # --- masks ------------------------------------------------------------------------------

    def fill_bitmask(
        self, items: Sequence[tuple[llguidance.LLMatcher, int, list[int]]], num_rows: int
    ) -> np.ndarray:
        """(num_rows, bitmask_width) int32: for each (matcher, row, draft), row `row` holds the
        tokens the matcher allows next and rows row + 1 ... row + len(draft) those it would
        allow after each draft token in turn (the matcher is left as it was). The library
        fills the rows in parallel in its own threads, without the GIL."""
        bitmask = np.empty((num_rows, self.bitmask_width), dtype=np.int32)
        plain = [(matcher, row) for matcher, row, draft in items if not draft]
        drafted = [item for item in items if item[2]]  # the library takes no empty draft
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, plain, bitmask)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self.executor, drafted, bitmask
            )
        return bitmask
