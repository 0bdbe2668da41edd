"""Log-probabilities reported to users: the top-k and the sampled token of one distribution.

Owns LogprobsTensors and the two halves of computing it: the log_softmax of a row of logits, and
the gather once the sampled tokens are known. Which logits (the raw ones, before any processing,
vLLM's default "raw_logprobs", or those the token was drawn from) is the Sampler's choice
(--logprobs-mode). Must not apply penalties, bias or filters, and must not move anything to the
host; the runner copies the result once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    # (num_reqs, k + 1) int64: the sampled token first, then the top-k, most likely first.
    token_ids: Tensor
    # (num_reqs, k + 1) float32, parallel to token_ids.
    logprobs: Tensor
    # (num_reqs,) int64: 1-based rank of the sampled token among the reported values.
    sampled_ranks: Tensor


def compute_logprobs(logits: Tensor) -> Tensor:
    """(num_reqs, vocab) float32 log-probabilities of `logits`, as a new tensor, so the caller
    may go on editing `logits` in place."""
    return logits.log_softmax(dim=1, dtype=torch.float32)


def gather_logprobs(
    logprobs: Tensor, num_logprobs: int, sampled_token_ids: Tensor
) -> LogprobsTensors:
    """The top `num_logprobs` of each row plus the sampled token's logprob and rank.

    `logprobs` is (num_reqs, vocab) from compute_logprobs (or logits, in a *_logits mode),
    `sampled_token_ids` (num_reqs,) int64.
    Raises ValueError when num_logprobs is negative or larger than the vocabulary.
    """
    vocab_size = logprobs.shape[1]
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(
            f"max_num_logprobs must be in [0, {vocab_size}] (the vocabulary), got {num_logprobs}."
        )
    # (num_reqs, num_logprobs), most likely first
    top_logprobs, top_token_ids = logprobs.topk(num_logprobs, dim=1)
    sampled = sampled_token_ids.unsqueeze(1)
    # (num_reqs, 1)
    sampled_logprobs = logprobs.gather(1, sampled)
    # Strictly greater, so a token tied with others gets the best rank of its tie group and the
    # raw argmax is always rank 1 (vLLM counts >= and would give a tie its worst rank).
    sampled_ranks = (logprobs > sampled_logprobs).sum(dim=1) + 1
    return LogprobsTensors(
        token_ids=torch.cat([sampled, top_token_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        sampled_ranks=sampled_ranks,
    )
