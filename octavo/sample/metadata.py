"""SamplingMetadata: one step's sampling parameters for the whole batch, as tensors; and the
table of per-row parameters the runner keeps for every request.

Owns only the shape of the data the model runner hands to the Sampler. The runner builds it from
its persistent batch (one row per request being sampled, in batch order); the sampler reads it and
never keeps it past the step. Must not know about requests, request ids or SamplingParams: a row
index is all that links a value to a request. No torch ops here, only the container.

Conventions, chosen so that a batch where nobody uses a feature costs nothing:
- A feature nobody in the batch uses is None (tensors) or empty (dicts), and the sampler skips it.
- Inside a tensor, a row that does not use the feature holds its neutral value (top_k 0, top_p
  1.0, min_p 0.0, penalties 0/0/1), so one batched op serves users and non-users alike.
- Every tensor lives on the device of the logits it is applied to.

The per-row parameters are the fields declared with `row_param`: each is a SamplingParams field
of the same name, which the runner's InputBatch keeps in a (max_num_reqs,) array and sends as
a (num_reqs,) tensor, or None when every row holds the neutral value. ROW_PARAMS lists them; a
new per-row parameter is one such field here, its SamplingParams field and its op.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class RowParam:
    """One per-row sampling parameter: its name (the SamplingParams field), array dtype, the
    value that means "off", whether its tensor is sent even when every row holds that value,
    and whether its op reads the prompt and output tokens (penalties)."""

    name: str
    dtype: type
    neutral: float
    always: bool = False
    reads_tokens: bool = False


def row_param(
    dtype: type, neutral: float, *, always: bool = False, reads_tokens: bool = False
) -> Any:
    """A SamplingMetadata field that is a per-row parameter (see the module's docstring)."""
    spec = {"dtype": dtype, "neutral": neutral, "always": always, "reads_tokens": reads_tokens}
    return field(metadata={"row_param": spec})


@dataclass(slots=True)
class SamplingMetadata:
    # --- per-row parameters, (num_reqs,) each ---
    # float32; 0.0 marks a greedy row. Always sent.
    temperature: Tensor = row_param(np.float32, 1.0, always=True)
    # int64, 0 = off.
    top_k: Tensor | None = row_param(np.int64, 0)
    # float32, 1.0 = off.
    top_p: Tensor | None = row_param(np.float32, 1.0)
    # float32, 0.0 = off.
    min_p: Tensor | None = row_param(np.float32, 0.0)
    # float32, 0 = off.
    presence_penalty: Tensor | None = row_param(np.float32, 0.0, reads_tokens=True)
    # float32, 0 = off.
    frequency_penalty: Tensor | None = row_param(np.float32, 0.0, reads_tokens=True)
    # float32, 1 = off.
    repetition_penalty: Tensor | None = row_param(np.float32, 1.0, reads_tokens=True)

    # --- derived from temperature ---
    # Every row greedy: the sampler skips everything random.
    all_greedy: bool = False
    # No row greedy: the sampler skips the argmax and the final torch.where.
    all_random: bool = False
    # Some random row's temperature is not 1: without one, the division (a pass over every
    # row's logits) is skipped, which changes nothing.
    scale_by_temperature: bool = False

    # --- the rest ---
    # Row -> the request's own generator (seeded requests only), on the logits' device.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # (num_reqs, max_prompt_len) int64, padded with vocab_size; None when no penalty is on.
    prompt_token_ids: Tensor | None = None
    # Per row, the tokens generated so far (penalties count them; empty lists are fine).
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Rows still below min_tokens: row -> token ids that must not be sampled (EOS + stop ids).
    min_tokens_stop_ids: dict[int, frozenset[int]] = field(default_factory=dict)
    # Rows with allowed_token_ids: row -> the only token ids it may sample.
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Rows whose bad_words forbid tokens this step: row -> those token ids.
    bad_words_banned: dict[int, frozenset[int]] = field(default_factory=dict)
    # Rows with a logit bias: row -> {token_id: bias added to the logit}.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # Largest `logprobs` k asked by any row; None when no row asked. Rows that asked for fewer
    # are trimmed by the runner.
    max_num_logprobs: int | None = None

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty is not None
            or self.frequency_penalty is not None
            or self.repetition_penalty is not None
        )


ROW_PARAMS: tuple[RowParam, ...] = tuple(
    RowParam(f.name, **f.metadata["row_param"])
    for f in dataclasses.fields(SamplingMetadata)
    if "row_param" in f.metadata
)
