"""SdpaAttention: paged attention through `torch.nn.functional.scaled_dot_product_attention`.

Any device, any dtype: the attention of GPUs until they get a backend of their own, and of a
CPU whose cache dtype the paged kernels do not read (float16). Two shapes of work, planned once
per forward:
- every single-token (decode) request together, in one padded SDPA call over keys gathered
  from the cache into (num_decodes, max_seq_len), padding hidden by a key mask;
- every multi-token chunk (a prompt, or the part of one after its cached prefix) in its own SDPA
  call: plain causal over this step's k/v when the chunk is the whole sequence, else keys
  gathered from the cache with a causal mask shifted by the prefix.
Decodes and chunks are kept apart because padding a decode to a chunk's query length (or a chunk
to the longest one) would multiply the work. GQA is left to SDPA (`enable_gqa`). No host syncs:
every shape comes from the metadata's Python ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends.base import AttentionBackend, AttentionPlan


@dataclass(slots=True)
class GatheredDecodes:
    """The decode requests, attended in one padded SDPA call over gathered blocks."""

    req_idx: list[int]
    # (num_decodes,) int64 rows of the flat batch; None when they are rows 0..n-1 in order.
    token_idx: Tensor | None
    max_num_blocks: int
    # (num_decodes * max_num_blocks,) int64, each request's blocks in order, padded with block
    # 0. Whole blocks are gathered (one index_select of block_size * heads * head_dim rows
    # each), several times faster on a CPU than gathering slot by slot.
    block_ids: Tensor
    # (num_decodes, 1, 1, max_num_blocks * block_size) bool, True where a key exists
    # (broadcast over heads); hides the tail of the last block and the padding blocks.
    key_mask: Tensor


@dataclass(slots=True)
class PrefillChunk:
    """One request with several query tokens (a whole prompt or a chunk of one)."""

    req_idx: int
    start: int  # first row in the flat batch
    end: int  # one past the last row
    # (seq_len,) int64 cache slots of all its keys; None when this chunk is the whole sequence,
    # so its keys are exactly this step's k/v and need no gather.
    kv_slots: Tensor | None
    # (query_len, seq_len) bool causal mask shifted by the cached prefix; None means plain causal.
    mask: Tensor | None


@dataclass(slots=True)
class GatherPlan(AttentionPlan):
    decode: GatheredDecodes | None = None
    chunks: list[PrefillChunk] = field(default_factory=list)


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def plan(self, metadata: AttentionMetadata, window: int = 0) -> GatherPlan:
        return GatherPlan(
            metadata, decode=_plan_decodes(metadata, window), chunks=_plan_chunks(metadata, window)
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        plan: GatherPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Tensor:
        # The window is in the plan's masks (the plan of `window`); a softcap needs the scores,
        # which SDPA never shows, so it computes them (_attention).
        attention = F.scaled_dot_product_attention if not softcap else _softcapped(softcap)
        decode = plan.decode
        if decode is not None and decode.token_idx is None:
            # All rows are decodes in batch order: the decode output is the whole output.
            return _decode(query, kv_cache, decode, scale, attention)
        output = query.new_empty(query.shape)
        if decode is not None:
            decode_query = query.index_select(0, decode.token_idx)
            decoded = _decode(decode_query, kv_cache, decode, scale, attention)
            output.index_copy_(0, decode.token_idx, decoded)
        key_slots = kv_cache[0].flatten(0, 1)  # (num_slots, num_kv_heads, head_dim)
        value_slots = kv_cache[1].flatten(0, 1)
        for chunk in plan.chunks:
            chunk_query = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1,H,q,D)
            if chunk.kv_slots is None:
                chunk_key = key[chunk.start : chunk.end]
                chunk_value = value[chunk.start : chunk.end]
            else:
                chunk_key = key_slots.index_select(0, chunk.kv_slots)
                chunk_value = value_slots.index_select(0, chunk.kv_slots)
            out = attention(
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


def _plan_decodes(metadata: AttentionMetadata, window: int) -> GatheredDecodes | None:
    req_idx = metadata.decode_idx()
    if not req_idx:
        return None
    device = metadata.block_table.device
    token_idx = None
    if not metadata.is_all_decode:
        token_idx = torch.tensor([metadata.query_start_loc[i] for i in req_idx], device=device)
    rows = metadata.block_rows(req_idx)
    max_num_blocks = rows.shape[1]
    seq_lens = torch.tensor([metadata.seq_lens[i] for i in req_idx], device=device)
    max_len = max_num_blocks * metadata.block_size
    key_pos = torch.arange(max_len, device=device).unsqueeze(0)
    key_mask = key_pos < seq_lens.unsqueeze(1)
    if window:
        key_mask &= key_pos >= (seq_lens - window).unsqueeze(1)
    return GatheredDecodes(
        req_idx=req_idx,
        token_idx=token_idx,
        max_num_blocks=max_num_blocks,
        block_ids=rows.reshape(-1).long(),
        key_mask=key_mask[:, None, None, :],  # (num_decodes, 1, 1, max_len)
    )


def _plan_chunks(metadata: AttentionMetadata, window: int) -> list[PrefillChunk]:
    device = metadata.block_table.device
    chunks = []
    for i in metadata.chunk_idx():
        q_len = metadata.query_lens[i]
        start, seq_len = metadata.query_start_loc[i], metadata.seq_lens[i]
        kv_slots = mask = None
        if seq_len > q_len:
            kv_slots = metadata.slots(i, seq_len)  # (seq_len,)
        if seq_len > q_len or (window and window < q_len):
            key_pos = torch.arange(seq_len, device=device).unsqueeze(0)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
            mask = key_pos <= query_pos  # (q_len, seq_len)
            if window:
                mask &= key_pos > query_pos - window
        chunks.append(PrefillChunk(i, start, start + q_len, kv_slots, mask))
    return chunks


def _decode(
    query: Tensor, kv_cache: Tensor, decode: GatheredDecodes, scale: float, attention: Callable
) -> Tensor:
    """query: (num_decodes, H, D) -> (num_decodes, H, D)."""
    num_decodes = query.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (num_decodes, decode.max_num_blocks * block_size, num_kv_heads, head_dim)
    keys = kv_cache[0].index_select(0, decode.block_ids).view(shape).to(query.dtype)
    values = kv_cache[1].index_select(0, decode.block_ids).view(shape).to(query.dtype)
    out = attention(
        query.unsqueeze(2),  # (num_decodes, H, 1, D)
        keys.transpose(1, 2),  # (num_decodes, Hkv, max_len, D)
        values.transpose(1, 2),
        attn_mask=decode.key_mask,
        scale=scale,
        enable_gqa=True,
    )  # (num_decodes, H, 1, D)
    return out.squeeze(2)


def _softcapped(softcap: float) -> Callable[..., Tensor]:
    """SDPA's contract (the calls above: a boolean mask or is_causal, GQA) with the scores
    soft-capped, softcap * tanh(score / softcap), before the mask; in float32."""

    def attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        scale: float = 1.0,
        enable_gqa: bool = True,
    ) -> Tensor:
        group = query.shape[1] // key.shape[1]
        key = key.float().repeat_interleave(group, dim=1)
        value = value.float().repeat_interleave(group, dim=1)
        scores = torch.tanh(query.float() @ key.transpose(-1, -2) * (scale / softcap)) * softcap
        if is_causal:
            q_len, k_len = scores.shape[-2:]
            attn_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        return (scores.softmax(-1) @ value).to(query.dtype)

    return attention
