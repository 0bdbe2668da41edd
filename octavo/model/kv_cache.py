"""The paged KV cache tensors: their layout, allocation, and the plain write into them.

One tensor per decoder layer, shape (2, num_blocks, block_size, num_kv_heads, head_dim):
index 0 holds keys, 1 values; block b's slot o is token slot b * block_size + o, so
`kv_cache[0].view(-1, num_kv_heads, head_dim)[slot]` is one token's keys. Keeping K and V of a
layer in one allocation makes the cache one list the runner passes through, and the
(block, offset, head, dim) order keeps one token's heads contiguous for the slot-wise writes.
Which blocks belong to whom is the core's business (KVCacheManager); this module never knows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.model import memory
from octavo.model.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    huge_pages: bool = True,
    layer_groups: tuple[tuple[int, int], ...] = (),
) -> list[Tensor]:
    """num_hidden_layers zero-filled tensors of (2, num_blocks, block_size, num_kv_heads,
    head_dim); with KV cache groups (`layer_groups`: each layer's (group, tensor),
    config.kv_cache_groups) as many tensors as a group has layers, layer i's the one its
    entry names (shared with the layers of the same place in the other groups). Zeros, not
    empty: backends read padded slots under a mask, and uninitialised memory may hold NaN or
    inf, which a mask does not cancel (0 * NaN is NaN). Filled here, so that the whole
    capacity is resident from the start, as stated. On CPU in huge pages
    (`memory.empty`): attention reads the cache a block at a time at scattered places."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}."
        )
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    if not layer_groups or len({group for group, _ in layer_groups}) == 1:
        return [
            memory.empty(shape, dtype, device, huge_pages).zero_()
            for _ in range(config.num_hidden_layers)
        ]
    tensors = [
        memory.empty(shape, dtype, device, huge_pages).zero_()
        for _ in range(1 + max(slot for _, slot in layer_groups))
    ]
    return [tensors[slot] for _, slot in layer_groups]


def write_kv_cache(kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Store key, value (num_tokens, num_kv_heads, head_dim) at their slots of `kv_cache`
    (this module's layout), converted to the cache dtype: index_copy_ into the flat slot views.
    AttentionBackend.write_kv_cache's plain version."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # (num_slots, kv_heads, head_dim)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_slots.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    value_slots.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
