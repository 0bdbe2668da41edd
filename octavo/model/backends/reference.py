"""ReferenceAttention: paged attention in plain torch, one request at a time.

The yardstick the fast backends are tested against, not a path to serve with. It reads keys and
values from the cache through the block table (never from the step's fresh k/v), computes
scores and softmax in float32 and masks with explicit positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends.base import AttentionBackend, AttentionPlan


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def plan(self, metadata: AttentionMetadata, window: int = 0) -> AttentionPlan:
        return AttentionPlan(metadata)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        plan: AttentionPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Tensor:
        metadata = plan.metadata
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        output = torch.empty_like(query)
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            seq_len = metadata.seq_lens[i]
            num_blocks = -(-seq_len // metadata.block_size)
            block_ids = metadata.block_table[i, :num_blocks].long()
            # (seq_len, num_kv_heads, head_dim): the request's blocks laid end to end.
            keys = kv_cache[0, block_ids].flatten(0, 1)[:seq_len].float()
            values = kv_cache[1, block_ids].flatten(0, 1)[:seq_len].float()
            # Each kv head serves num_heads // num_kv_heads consecutive query heads.
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)

            output[start:end] = attend(query[start:end], keys, values, scale, window, softcap).to(
                query.dtype
            )
        return output


def attend(
    query: Tensor, keys: Tensor, values: Tensor, scale: float, window: int, softcap: float
) -> Tensor:
    """The attention of one sequence's query rows, the last q_len of its seq_len positions, over
    all its keys and values, in float32: query (q_len, num_heads, head_dim); keys, values
    (seq_len, num_heads, head_dim), one per query head. Row j (position seq_len - q_len + j)
    sees keys up to its position and, under a window, only the last `window` of them; a
    softcap turns scores into softcap * tanh(score / softcap) before the mask, as transformers
    does. Returns (q_len, num_heads, head_dim) float32."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
    visible = key_pos <= query_pos  # (q_len, seq_len)
    if window:
        visible &= key_pos > query_pos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values.float())
