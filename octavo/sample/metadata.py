"""SamplingMetadata: one step's sampling parameters for the whole batch, as tensors.

Owns only the shape of the data the model runner hands to the Sampler. The runner builds it from
its persistent batch (one row per request being sampled, in batch order); the sampler reads it and
never keeps it past the step. Must not know about requests, request ids or SamplingParams: a row
index is all that links a value to a request. No torch ops here, only the container.

Conventions, chosen so that a batch where nobody uses a feature costs nothing:
- A feature nobody in the batch uses is None (tensors) or empty (dicts), and the sampler skips it.
- Inside a tensor, a row that does not use the feature holds its neutral value (top_k 0, top_p
  1.0, min_p 0.0, penalties 0/0/1), so one batched op serves users and non-users alike.
- Every tensor lives on the device of the logits it is applied to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class SamplingMetadata:
    # (num_reqs,) float32; 0.0 marks a greedy row.
    temperature: Tensor
    # Every row greedy: the sampler skips everything random.
    all_greedy: bool
    # No row greedy: the sampler skips the argmax and the final torch.where.
    all_random: bool
    # Some random row's temperature is not 1: without one, the division (a pass over every
    # row's logits) is skipped, which changes nothing.
    scale_by_temperature: bool
    # (num_reqs,) int64, 0 = off; None when no row uses top-k.
    top_k: Tensor | None
    # (num_reqs,) float32, 1.0 = off; None when no row uses top-p.
    top_p: Tensor | None
    # (num_reqs,) float32, 0.0 = off; None when no row uses min-p.
    min_p: Tensor | None
    # Row -> the request's own generator (seeded requests only), on the logits' device.
    generators: dict[int, torch.Generator]
    # Penalties: all three None when no row uses any penalty.
    # (num_reqs,) float32, 0 = off.
    presence_penalties: Tensor | None
    # (num_reqs,) float32, 0 = off.
    frequency_penalties: Tensor | None
    # (num_reqs,) float32, 1 = off.
    repetition_penalties: Tensor | None
    # (num_reqs, max_prompt_len) int64, padded with vocab_size; None when penalties are None.
    prompt_token_ids: Tensor | None
    # Per row, the tokens generated so far (penalties count them; empty lists are fine).
    output_token_ids: list[list[int]]
    # Rows still below min_tokens: row -> token ids that must not be sampled (EOS + stop ids).
    min_tokens_stop_ids: dict[int, set[int]]
    # Rows with a logit bias: row -> {token_id: bias added to the logit}.
    logit_bias: dict[int, dict[int, float]]
    # Largest `logprobs` k asked by any row; None when no row asked. Rows that asked for fewer
    # are trimmed by the runner.
    max_num_logprobs: int | None

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalties is not None
            or self.frequency_penalties is not None
            or self.repetition_penalties is not None
        )
