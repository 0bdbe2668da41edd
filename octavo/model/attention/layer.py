"""PagedAttention: the attention step of one decoder layer over the paged KV cache.

Owns the order of operations: first every scheduled token's k and v go into the cache at
`slot_mapping`, then a backend attends from the cache. Writing all before reading matters: two
requests that share prefix blocks, scheduled in the same step, read keys the other has just
written in this same layer call. Projections and RoPE belong to the model, not here.
"""

from __future__ import annotations

from torch import Tensor, nn

from octavo.model import kernels
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.attention.reference import reference_attention
from octavo.model.attention.sdpa import sdpa_attention


def write_kv_cache(kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Store key, value (num_tokens, num_kv_heads, head_dim) at their slots of kv_cache
    (2, num_blocks, block_size, num_kv_heads, head_dim), converting to the cache dtype."""
    if kernels.use_kv_cache_write(key, value, kv_cache):
        kernels.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # (num_slots, kv_heads, head_dim)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_slots.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    value_slots.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: AttentionMetadata,
    ) -> Tensor:
        """query: (num_tokens, num_heads, head_dim); key, value: (num_tokens, num_kv_heads,
        head_dim). Mutates kv_cache (this step's slots). Returns (num_tokens, num_heads *
        head_dim)."""
        write_kv_cache(kv_cache, key, value, metadata.slot_mapping)
        if metadata.backend == "reference":
            output = reference_attention(query, kv_cache, metadata, self.scale)
        else:
            output = sdpa_attention(query, key, value, kv_cache, metadata, self.scale)
        return output.flatten(1, 2)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
