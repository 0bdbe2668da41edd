"""SamplingParams: the per-request knobs a user sets, with vLLM's names, defaults and checks.

Plain data, no torch. Invalid values raise ValueError naming the field and its value, before
a request is ever admitted.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

# A seed is any signed or unsigned 64-bit integer (what torch's generators take; OpenAI's
# seeds are 64-bit).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# The longest structured-output constraint (schema, regex, grammar, choices), in characters.
MAX_CONSTRAINT_CHARS = 256 * 1024
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by a tiny
# temperature overflows, and the result would be argmax anyway.
_GREEDY_TEMPERATURE_EPS = 1e-5
# The most bad_words one request may list (each is tokenized twice when it is admitted).
MAX_BAD_WORDS = 128

# vLLM SamplingParams fields octavo does not implement, each with the values that mean "off"
# (vLLM's default, and None). Setting one to anything else is a ValueError naming it, so that
# no vLLM field is ever silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "logprob_token_ids": (None,),
    "flat_logprobs": (None, False),
    "detokenize": (None, True),
    "stream_interval": (None, 1),
    "skip_clone": (None, False),
    "extra_args": (None,),
    "skip_reading_prefix_cache": (None, False),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    "routed_experts_prompt_start": (None, 0),
    "trace_decode_token_ids": (None,),
}


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a streaming caller carries (vLLM's name and values)."""

    # Every completion, with all text and token ids so far.
    CUMULATIVE = 0
    # Only the completions that changed, with only what is new since their last output.
    DELTA = 1
    # Nothing until every completion has finished, then everything once.
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, enforced while sampling (vLLM's `structured_outputs`).

    Exactly one of the fields is set: `json` (a JSON schema, as a dict or its JSON text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings), or `grammar`
    (a Lark / EBNF grammar). Plain data: compiling it is the structured-output backend's job.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}."
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, "
                f"got {self.choice!r}."
            )
        # Compiling a constraint is work before admission; its size bounds that work.
        size = len(self.key[1])
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured_outputs.{self.kind} is {size} characters long; at most "
                f"{MAX_CONSTRAINT_CHARS} are accepted."
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            if getattr(self, name) not in (None, False):
                return name
        raise AssertionError("unreachable: checked in __post_init__")

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity for caching a compiled grammar: (kind, canonical text)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return ("json", json.dumps(value, sort_keys=True, separators=(",", ":")))
        if self.kind == "choice":
            return ("choice", json.dumps(value))
        return (self.kind, str(value))


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's: for each prompt token after the first, its logprob and the top prompt_logprobs
    # (-1: the whole vocabulary), in RequestOutput.prompt_logprobs. A request that asks for
    # them recomputes its whole prompt: it never reads the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Only these token ids may be sampled (vLLM's); ids beyond the vocabulary are refused
    # when the request is added.
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated (vLLM's rule): each is tokenized with and without a
    # leading space, and a sequence's last token is forbidden wherever the output so far ends
    # with the tokens before it.
    bad_words: list[str] | None = None
    # Keep only the last N prompt tokens (vLLM's); -1: as many as max_model_len leaves
    # after max_tokens (all but one when max_tokens is None).
    truncate_prompt_tokens: int | None = None
    # How an engine that streams (AsyncLLMEngine, LLMEngine.step) reports this request; the
    # offline LLM and the server choose their own.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Set by the engine when the request is added (bad_words as token id sequences); a value
    # given here is replaced then.
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's fields octavo does not implement: only their "off" values are accepted
    # (UNSUPPORTED_FIELDS).
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    stream_interval: int | None = None
    skip_clone: bool = False
    extra_args: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        # Duplicates dropped, order kept (vLLM's rule).
        self.bad_words = list(dict.fromkeys(self.bad_words or []))
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's spelling of "no seed"
            self.seed = None
        self._verify()
        # An int that crossed a process boundary becomes the enum again.
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.temperature < _GREEDY_TEMPERATURE_EPS:
            # Greedy: the filters cannot change the argmax, so turn them off.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify(self) -> None:
        def bad(name: str, value: object, must: str) -> ValueError:
            return ValueError(f"{name} must be {must}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, value, "in [-2, 2]")
        # The sampler computes in float32: a value must keep its meaning there (1e-46 is 0 and
        # 1e39 is inf in float32; a repetition penalty of 0 turns logits into NaN).
        if not 0.0 < _float32(self.repetition_penalty) < math.inf:
            raise bad("repetition_penalty", self.repetition_penalty, "positive and finite")
        if not 0.0 <= _float32(self.temperature) < math.inf:
            raise bad("temperature", self.temperature, "non-negative and finite")
        if not 0.0 < _float32(self.top_p) <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (disabled), or at least 1")
        if not 0.0 <= _float32(self.min_p) <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "a non-negative integer")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < -1
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "a non-negative integer or -1")
        if self.seed is not None:
            if not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED:
                raise bad("seed", self.seed, "a 64-bit integer")
            # n > 1: child i draws with seed + i (vLLM's rule); each must be a seed too.
            if self.seed + self.n - 1 > MAX_SEED:
                raise bad("seed", self.seed, f"at most {MAX_SEED - self.n + 1} with n={self.n}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        for name, off in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            empty = isinstance(value, (list, dict)) and not value
            if not empty and not any(
                value is v or (type(value) is type(v) and value == v) for v in off
            ):
                raise ValueError(f"{name}={value!r} is not supported by octavo.")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", self.bad_words, "a list of non-blank strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise bad("bad_words", len(self.bad_words), f"at most {MAX_BAD_WORDS} words")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 or at least 1")
        if self.output_kind not in tuple(RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise bad("logit_bias", token_id, "keyed by non-negative token ids")
                if not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", bias, "values in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A copy the engine keeps (one per child of an n > 1 request): lists copied, not
        shared, so a caller changing its own SamplingParams later changes nothing queued."""
        return dataclasses.replace(
            self,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=None
            if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
            bad_words=list(self.bad_words),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float32(value: float) -> float:
    """`value` as the float32 the sampler will hold (inf beyond its range, NaN stays NaN)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
    except struct.error:  # not a number at all: the comparison that follows fails
        return math.nan


@dataclass
class BeamSearchParams:
    """The knobs of a beam search (vLLM's `BeamSearchParams`, its names and defaults).

    Each step, every live beam's next-token logprobs give 2 * beam_width candidates; the best
    beam_width by cumulative logprob that do not end in EOS live on, those that do are set
    aside as finished. After max_tokens steps (or when no beam is left) the finished and live
    beams are ranked by cum_logprob / length ** length_penalty, where length counts the
    prompt's tokens and the beam's, a final EOS left out (vLLM's score), and the best
    beam_width are returned. `temperature` is that of the draw each step makes: the logprobs
    are the model's raw ones whatever it is, and a drawn token outside the top candidates
    joins them (vLLM's rule). Plain data; ValueError names a bad field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # vLLM's fields octavo's beam search does not implement: only their "off" values.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: object, must: str) -> ValueError:
            return ValueError(f"{name} must be {must}, got {value!r}.")

        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise bad("beam_width", self.beam_width, "an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not 0.0 <= _float32(self.temperature) < math.inf:
            raise bad("temperature", self.temperature, "non-negative and finite")
        if not math.isfinite(self.length_penalty):
            raise bad("length_penalty", self.length_penalty, "finite")
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs is not supported with beam search by octavo.")
        if self.watermarking:
            raise ValueError("watermarking=True is not supported by octavo.")
