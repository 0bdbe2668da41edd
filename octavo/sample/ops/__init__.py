"""Batched tensor operations the Sampler composes, one concern per module.

- allowed: allowed_token_ids and bad_words masks.
- penalties: logit bias, min_tokens masking, repetition/frequency/presence penalties.
- topk_topp: temperature, min-p, top-k, top-p and the inverse-CDF draw.
- logprobs: raw log-probabilities, their top-k and the sampled token's rank.

Everything here takes plain tensors and dicts keyed by row; nothing knows about requests.
"""

from octavo.sample.ops.allowed import apply_allowed_token_ids, banned_by_bad_words
from octavo.sample.ops.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from octavo.sample.ops.penalties import (
    apply_banned_token_ids,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    get_token_counts,
    pad_token_ids,
)
from octavo.sample.ops.topk_topp import (
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    draw_uniforms,
    random_sample,
)

__all__ = [
    "LogprobsTensors",
    "apply_allowed_token_ids",
    "apply_banned_token_ids",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "banned_by_bad_words",
    "compute_logprobs",
    "draw_uniforms",
    "gather_logprobs",
    "get_token_counts",
    "pad_token_ids",
    "random_sample",
]
