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

    def plan(self, metadata: AttentionMetadata) -> AttentionPlan:
        return AttentionPlan(metadata)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        plan: AttentionPlan,
        scale: float,
    ) -> Tensor:
        metadata = plan.metadata
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        output = torch.empty_like(query)
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            query_len, seq_len = end - start, metadata.seq_lens[i]
            num_blocks = -(-seq_len // metadata.block_size)
            block_ids = metadata.block_table[i, :num_blocks].long()
            # (seq_len, num_kv_heads, head_dim): the request's blocks laid end to end.
            keys = kv_cache[0, block_ids].flatten(0, 1)[:seq_len].float()
            values = kv_cache[1, block_ids].flatten(0, 1)[:seq_len].float()
            # Each kv head serves num_heads // num_kv_heads consecutive query heads.
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)

            scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale
            query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (query_len, seq_len)
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # (num_heads, query_len, seq_len)
            output[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
        return output
