"""Rejection sampling for speculative decoding: which proposed tokens a step keeps, and the one
token it emits after them, such that the emitted tokens follow the target model's distribution
exactly (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding").

For proposed tokens d_1..d_k, drawn from proposal distributions q_1..q_k, and the target's
distributions p_1..p_k+1 at the k + 1 verified positions: d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)), in order; at the first rejection the step emits one token drawn
from norm(max(0, p_i - q_i)) and stops; when all k are accepted it emits a bonus token drawn
from p_k+1. Each emitted token is then distributed as p at its position.

Two entry points:
- `rejection_sample`: the rule above, batched over requests, for any q (a draft model's full
  distributions, or one-hot ones); the reference the tests hold to the target distribution.
- `num_accepted_one_hot`: the same rule where every q_i is one-hot (n-gram and suffix
  proposals are a token, not a distribution), computed from tokens the ordinary sampler drew
  from p_1..p_k+1 at every position: accept while the drawn token equals the proposal, emit the
  first drawn token that differs (or the last). With q_i one-hot at d_i, the acceptance
  probability min(1, p_i(d_i)) is P(drawn = d_i), and norm(max(0, p_i - q_i)) is p_i with d_i
  removed, which is the law of the drawn token given that it is not d_i: the two rules are the
  same law. This form lets a proposal's verification reuse the sampler as it is (penalties,
  filters, logprobs, the CPU draw kernel, seeded generators): greedy rows accept exactly while
  the argmax equals the proposal, and a seeded request emits the same tokens with or without
  speculation once its generator is set back to the draws it used (the runner does).

Must not know about requests: rows and tensors only.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Padding of `rejection_sample`'s output after a row's last emitted token.
PLACEHOLDER_TOKEN_ID = -1


def num_accepted_one_hot(drawn_token_ids: list[int], draft_token_ids: list[int]) -> int:
    """How many of one row's proposed tokens are accepted, where `drawn_token_ids` (k + 1)
    were sampled from the target at the k + 1 verified positions and `draft_token_ids` (k) are
    the one-hot proposals: the length of their common prefix. The row then emits
    drawn_token_ids[: accepted + 1]."""
    accepted = 0
    for drawn, draft in zip(drawn_token_ids, draft_token_ids):
        if drawn != draft:
            break
        accepted += 1
    return accepted


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Leviathan et al.'s rule for a batch of rows.

    target_probs: (num_rows, k + 1, vocab) float, p at each verified position;
    draft_token_ids: (num_rows, k) int64, the proposed tokens;
    draft_probs: (num_rows, k, vocab) float, the q each proposal was drawn from; None: one-hot
    at the proposal (an n-gram's). Returns (num_rows, k + 1) int64: each row's accepted
    proposals, then its recovered or bonus token, then PLACEHOLDER_TOKEN_ID.
    """
    num_rows, num_positions, vocab_size = target_probs.shape
    k = num_positions - 1
    device = target_probs.device
    if draft_probs is None:
        draft_probs = torch.zeros(num_rows, k, vocab_size, device=device)
        draft_probs.scatter_(2, draft_token_ids.unsqueeze(2), 1.0)
    # (num_rows, k): p and q of each proposed token.
    p_draft = target_probs[:, :k].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    q_draft = draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    # u < p / q, written without the division (q > 0: the proposal was drawn from q).
    uniform = torch.rand(num_rows, k, device=device, generator=generator)
    accepted = uniform * q_draft < p_draft
    # (num_rows,): accepted proposals before the first rejection.
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # (num_rows, k, vocab): the recovery distribution at each proposed position. A row where
    # p == q has no mass left, but also never rejects there; p keeps its draw well defined.
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    # (num_rows, k + 1): the token emitted if the row stopped at each position.
    fallback = torch.cat([residual, target_probs[:, k:]], dim=1)
    stop_token_ids = torch.multinomial(
        fallback.reshape(-1, vocab_size), 1, generator=generator
    ).view(num_rows, num_positions)
    positions = torch.arange(num_positions, device=device).unsqueeze(0)
    stop_at = num_accepted.unsqueeze(1)
    proposed = torch.cat(
        [draft_token_ids, torch.full((num_rows, 1), PLACEHOLDER_TOKEN_ID, device=device)], dim=1
    )
    output = torch.where(positions < stop_at, proposed, stop_token_ids)
    return output.masked_fill(positions > stop_at, PLACEHOLDER_TOKEN_ID)
