"""Sampler: one step's logits in, one token per row (and optionally logprobs) out.

Owns the order in which the logits processors and filters run, the greedy/random split and the
output types. Must not know about requests (rows only), must not copy results to the host (the
runner does that once per step) and must not keep state between steps: everything per request
arrives in SamplingMetadata, including the seeded generators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from octavo.sample.metadata import SamplingMetadata
from octavo.sample.ops.allowed import apply_allowed_token_ids
from octavo.sample.ops.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from octavo.sample.ops.penalties import (
    apply_banned_token_ids,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    pad_token_ids,
)
from octavo.sample.ops.topk_topp import (
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    draw_uniforms,
    random_sample,
)

__all__ = ["LOGPROBS_MODES", "LogprobsTensors", "Sampler", "SamplerOutput"]

# vLLM's --logprobs-mode values: which numbers the reported "logprobs" are. raw_*: of the
# model's logits as they come (step 1 below); processed_*: of the logits the token was drawn
# from (after steps 2-9); *_logprobs: log_softmax of those, *_logits: the logits themselves.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    # (num_reqs,) int64
    sampled_token_ids: Tensor
    # Set when metadata.max_num_logprobs is not None.
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    """Samples one token per row of (num_reqs, vocab) float32 logits. Steps, in order:

    1) Logprobs, if any row asked and the mode is raw: log_softmax of the raw logits (vLLM's
       default "raw_logprobs"), or a copy of them ("raw_logits"), before anything below
       touches them.
    2) Token masks: -inf outside a row's allowed_token_ids and on what its bad_words forbid
       this step; then the logit bias: each row's {token_id: bias} is added.
    3) min_tokens: a row still below its min_tokens gets -inf on its EOS and stop ids.
    4) Penalties (vLLM/OpenAI): repetition over prompt and output tokens, then frequency and
       presence over output tokens.
    5) Greedy rows: argmax of the logits as processed so far. If every row is greedy, the sample
       is done; nothing random runs.
    6) Temperature: random rows are divided by theirs (skipped when every one is 1).
    7) min-p, then 8) top-k, then 9) top-p: dropped tokens get -inf.
    10) Random rows: softmax, then inverse-CDF sampling (one uniform per row against the
        cumulative mass), seeded rows drawing their uniform from their own generator. With a
        `draw` function (the CPU kernel the model runner passes in), the logits and uniforms
        go to it instead, which does the softmax and the search in one pass.
    11) Greedy and random rows are combined with torch.where on temperature == 0.
    12) Logprobs: the top max_num_logprobs of what step 1 kept, or, in a processed mode, of the
        logits as the draw saw them (after step 9; after step 4 when every row is greedy,
        whose filters are off: SamplingParams turns them off for a greedy request), with the
        sampled token's value and 1-based rank in front. Tokens the filters dropped are -inf.

    Steps 2-4 can change the argmax, so they come before the greedy pick; 6-9 cannot, so greedy
    rows skip them. `logits` is modified in place. Structured-output rows arrive already masked
    by the runner (ops/bitmask.py), so "raw" here means raw within the grammar.
    """

    def __init__(
        self,
        draw: Callable[[Tensor, Tensor], Tensor] | None = None,
        logprobs_mode: str = "raw_logprobs",
        argmax: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """draw(logits, uniform): step 10 as one function of the filtered (num_reqs, vocab)
        float32 logits (which it may overwrite) and (num_reqs, 1) uniforms in [0, 1), returning
        (num_reqs,) int64 with random_sample's meaning; None: softmax and random_sample.
        argmax(logits): step 5's pick, (num_reqs,) int64 as logits.argmax(dim=1) gives it;
        None: that.
        logprobs_mode: one of LOGPROBS_MODES (ValueError otherwise)."""
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {logprobs_mode!r}."
            )
        self.draw = draw
        self.argmax = argmax
        self.logprobs_mode = logprobs_mode
        self._raw = logprobs_mode.startswith("raw_")
        self._as_logprobs = logprobs_mode.endswith("_logprobs")

    def forward(self, logits: Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: (num_reqs, vocab) float32, one row per request being sampled, in the row
        order of `metadata`. May modify logits in place. Raises ValueError for a logit_bias id
        or a max_num_logprobs outside the vocabulary."""
        # Every op below assumes float32 (min-p's log threshold, -inf fills, bias values); a
        # half-precision caller pays one copy here rather than silent precision loss.
        if logits.dtype != torch.float32:
            logits = logits.float()
        wanted = metadata.max_num_logprobs is not None
        # 1)
        reported = None
        if wanted and self._raw:
            reported = self._reported(logits)
        # 2) - 4)
        self.apply_logits_processors(logits, metadata)
        # 5) - 11)
        sampled_token_ids, processed = self.sample(logits, metadata, wanted and not self._raw)
        # 12)
        logprobs = None
        if wanted:
            reported = processed if reported is None else reported
            logprobs = gather_logprobs(reported, metadata.max_num_logprobs, sampled_token_ids)
        return SamplerOutput(sampled_token_ids=sampled_token_ids, logprobs=logprobs)

    def _reported(self, logits: Tensor) -> Tensor:
        """What the logprobs are taken from, as a new tensor (the steps after this one edit
        `logits` in place, and the draw may overwrite it)."""
        return compute_logprobs(logits) if self._as_logprobs else logits.clone()

    @staticmethod
    def apply_logits_processors(logits: Tensor, metadata: SamplingMetadata) -> None:
        """Steps 2-4, in place: masks, bias, min_tokens, penalties. Each is skipped when no row
        uses it."""
        apply_allowed_token_ids(logits, metadata.allowed_token_ids)
        apply_banned_token_ids(logits, metadata.bad_words_banned)
        apply_logit_bias(logits, metadata.logit_bias)
        apply_min_tokens(logits, metadata.min_tokens_stop_ids)
        if metadata.has_penalties:
            vocab_size = logits.shape[1]
            # (num_reqs, max_output_len), padded with vocab_size like prompt_token_ids.
            output_token_ids = pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
            apply_penalties(
                logits,
                metadata.prompt_token_ids,
                output_token_ids,
                metadata.presence_penalty,
                metadata.frequency_penalty,
                metadata.repetition_penalty,
            )

    def sample(
        self, logits: Tensor, metadata: SamplingMetadata, keep_processed: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Steps 5-11: (num_reqs,) int64 token ids, and, with `keep_processed`, the reported
        values (logprobs_mode's) of the logits they were drawn from (else None). Overwrites
        `logits` on the random path."""
        greedy = None
        if not metadata.all_random:
            # 5) Taken before temperature and the filters rewrite the logits.
            greedy = logits.argmax(dim=1) if self.argmax is None else self.argmax(logits)
            if metadata.all_greedy:
                return greedy, self._reported(logits) if keep_processed else None
        # 6) - 9)
        if metadata.scale_by_temperature:
            apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        processed = self._reported(logits) if keep_processed else None
        # 10)
        if self.draw is not None:
            uniform = draw_uniforms(logits.shape[0], metadata.generators, logits.device)
            sampled = self.draw(logits, uniform)
        else:
            sampled = random_sample(logits.softmax(dim=1), metadata.generators)
        if greedy is None:
            return sampled, processed
        # 11)
        return torch.where(metadata.temperature == 0.0, greedy, sampled), processed
