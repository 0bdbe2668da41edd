"""Paged attention through `torch.nn.functional.scaled_dot_product_attention`.

Two shapes of work, planned once per forward in AttentionMetadata:
- every single-token (decode) request together: on a CPU with the kernels built, the paged
  decode kernel reads each request's blocks in place; otherwise one padded SDPA call over keys
  gathered from the cache into (num_decodes, max_seq_len), padding hidden by a key mask;
- every multi-token chunk (a prompt, or the part of one after its cached prefix): on a CPU with
  the kernels built, all of them in one call of the paged prefill kernel, which reads their keys
  in place; otherwise each in its own SDPA call: plain causal over this step's k/v when the chunk
  is the whole sequence, else keys gathered from the cache with a causal mask shifted by the
  prefix.
Decodes and chunks are kept apart because padding a decode to a chunk's query length (or a chunk
to the longest one) would multiply the work. GQA is left to SDPA (`enable_gqa`). No host syncs:
every shape comes from the metadata's Python ints. Must not write to the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model import kernels
from octavo.model.attention.metadata import AttentionMetadata


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> Tensor:
    """query: (num_tokens, num_heads, head_dim); key, value: (num_tokens, num_kv_heads,
    head_dim), this step's (already in the cache); kv_cache: (2, num_blocks, block_size,
    num_kv_heads, head_dim). Returns (num_tokens, num_heads, head_dim) in query's dtype."""
    decode, prefill = metadata.decode, metadata.prefill
    if decode is not None and decode.token_idx is None:
        # All rows are decodes in batch order: the decode output is the whole output.
        return _decode(query, kv_cache, metadata, scale)

    dtype = query.dtype
    if prefill is not None and not (dtype == torch.float32 and kernels.heads_contiguous(query)):
        query = query.float().contiguous()  # what the prefill kernel reads
    output = query.new_empty(query.shape)
    if decode is not None:
        decode_query = query.index_select(0, decode.token_idx)
        output.index_copy_(0, decode.token_idx, _decode(decode_query, kv_cache, metadata, scale))
    if prefill is not None:
        kernels.paged_prefill_attention(
            output,
            query,
            kv_cache[0],
            kv_cache[1],
            prefill.block_table,
            prefill.query_start,
            prefill.query_lens,
            prefill.seq_lens,
            scale,
        )
        return output if output.dtype == dtype else output.to(dtype)
    key_slots = kv_cache[0].flatten(0, 1)  # (num_slots, num_kv_heads, head_dim)
    value_slots = kv_cache[1].flatten(0, 1)
    for chunk in metadata.chunks:
        chunk_query = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
        if chunk.kv_slots is None:
            chunk_key, chunk_value = key[chunk.start : chunk.end], value[chunk.start : chunk.end]
        else:
            chunk_key = key_slots.index_select(0, chunk.kv_slots)
            chunk_value = value_slots.index_select(0, chunk.kv_slots)
        out = F.scaled_dot_product_attention(
            chunk_query,
            chunk_key.to(query.dtype).transpose(0, 1).unsqueeze(0),  # (1, Hkv, seq_len, D)
            chunk_value.to(query.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # (1, H, q, D)
        output[chunk.start : chunk.end] = out[0].transpose(0, 1)
    return output


def _decode(query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float) -> Tensor:
    """query: (num_decodes, H, D) -> (num_decodes, H, D)."""
    decode = metadata.decode
    if decode.block_table is not None:
        return kernels.paged_decode_attention(
            query, kv_cache[0], kv_cache[1], decode.block_table, decode.seq_lens, scale
        )
    num_decodes = query.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (num_decodes, decode.max_num_blocks * block_size, num_kv_heads, head_dim)
    keys = kv_cache[0].index_select(0, decode.block_ids).view(shape).to(query.dtype)
    values = kv_cache[1].index_select(0, decode.block_ids).view(shape).to(query.dtype)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # (num_decodes, H, 1, D)
        keys.transpose(1, 2),  # (num_decodes, Hkv, max_len, D)
        values.transpose(1, 2),
        attn_mask=decode.key_mask,
        scale=scale,
        enable_gqa=True,
    )  # (num_decodes, H, 1, D)
    return out.squeeze(2)
