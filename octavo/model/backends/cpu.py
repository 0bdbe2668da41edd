"""The CPU backend's parts over the C++ kernels (model/cpu/): CpuKernelOps and PagedAttention.

CpuKernelOps serves float32 compute (the kernels' dtype): RMSNorm with its residual add and
rotary embedding in place, SiLU-and-mul in one pass; Qwen3's per-head norms stay on torch's ops,
whose views the norm kernel does not take. CpuPagedAttention reads a float32 or bfloat16 cache in
place, block by block, for decodes and prompt chunks alike; for float32 compute it writes the
cache with the kernel too. select.py decides when each is used; each has its reference in
TorchOps and ReferenceAttention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends.base import AttentionBackend, AttentionPlan
from octavo.model.backends.torch_ops import TorchOps
from octavo.model.cpu import ops
from octavo.model.kv_cache import write_kv_cache as torch_write_kv_cache


class CpuKernelOps(TorchOps):
    """The layer ops for float32 compute on a CPU with the kernels loaded."""

    name = "cpu_kernels"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = x.clone()
        ops.rms_norm_(out, weight, eps)
        return out

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        # Both are fresh outputs of the layer before (contiguous): contiguous() is a no-op.
        x, residual = x.contiguous(), residual.contiguous()
        ops.rms_norm_(x, weight, eps, residual)
        return x, residual

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ops.rotary_(x, cos, sin)
        return x

    def act_and_mul(self, act: str) -> Callable[[Tensor], Tensor]:
        if act == "silu":
            return ops.silu_and_mul
        return super().act_and_mul(act)

    def act_and_mul_rounds_once(self, act: str) -> bool:
        return act == "silu"


@dataclass(slots=True)
class PagedDecodes:
    """The decode requests, for the paged decode kernel: (num_decodes, max_num_blocks) int32
    block ids and (num_decodes,) int32 sequence lengths."""

    # (num_decodes,) int64 rows of the flat batch; None when they are rows 0..n-1 in order.
    token_idx: Tensor | None
    block_table: Tensor
    seq_lens: Tensor


@dataclass(slots=True)
class PagedPrefills:
    """Every request with several query tokens, for one call of the paged prefill kernel:
    (num_chunks, max_num_blocks) int32 block ids and (num_chunks,) int32 first rows in the
    flat batch, query lengths and sequence lengths."""

    block_table: Tensor
    query_start: Tensor
    query_lens: Tensor
    seq_lens: Tensor


@dataclass(slots=True)
class PagedPlan(AttentionPlan):
    decode: PagedDecodes | None = None
    prefill: PagedPrefills | None = None


class CpuPagedAttention(AttentionBackend):
    """Decodes through the paged decode kernel, prompt chunks through the paged prefill kernel,
    both reading keys and values where they lie in a float32 or bfloat16 cache."""

    name = "cpu_paged"

    def __init__(
        self, compute_dtype: torch.dtype, prefill_tiles: bool = False, decode_bf16: bool = False
    ) -> None:
        # The write kernel takes float32 keys and values (float32 compute); else torch's.
        self._write = (
            _kernel_write_kv_cache if compute_dtype == torch.float32 else torch_write_kv_cache
        )
        # Prompt chunks in bfloat16 products (a bfloat16 cache on a CPU with AMX-BF16 or
        # AVX512-BF16; select.py).
        self.prefill_tiles = prefill_tiles
        # Decodes in bfloat16 dot products (the same cache and CPU condition; the fused decode
        # layer reads this too, fused.py).
        self.decode_bf16 = decode_bf16

    def choices(self) -> dict[str, str]:
        rounded = "bfloat16 queries and weights, float32 sums"
        decode = f"avx512_bf16 (head sizes 64, 128; float32 others): {rounded}"
        choices = {"decode_attention": decode if self.decode_bf16 else "float32"}
        if not self.prefill_tiles:
            return {**choices, "prefill_attention": "float32"}
        unit = "amx_tiles" if ops.amx_tiles_available() else "avx512_bf16"
        return {**choices, "prefill_attention": f"{unit}: {rounded}"}

    def plan(self, metadata: AttentionMetadata, window: int = 0) -> PagedPlan:
        return PagedPlan(metadata, decode=_plan_decodes(metadata), prefill=_plan_prefills(metadata))

    def write_kv_cache(
        self, kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
    ) -> None:
        self._write(kv_cache, key, value, slot_mapping)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        plan: PagedPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Tensor:
        decode, prefill = plan.decode, plan.prefill
        if decode is not None and decode.token_idx is None:
            # All rows are decodes in batch order: the decode output is the whole output.
            return _decode(query, kv_cache, decode, scale, window, softcap, self.decode_bf16)
        dtype = query.dtype
        if not (dtype == torch.float32 and ops.heads_contiguous(query)):
            query = query.float().contiguous()  # what the prefill kernel reads
        output = query.new_empty(query.shape)
        if decode is not None:
            decode_query = query.index_select(0, decode.token_idx)
            decoded = _decode(
                decode_query, kv_cache, decode, scale, window, softcap, self.decode_bf16
            )
            output.index_copy_(0, decode.token_idx, decoded)
        assert prefill is not None  # not all decodes: some request has several query tokens
        ops.paged_prefill_attention(
            output,
            query,
            kv_cache[0],
            kv_cache[1],
            prefill.block_table,
            prefill.query_start,
            prefill.query_lens,
            prefill.seq_lens,
            scale,
            window,
            softcap,
            self.prefill_tiles,
        )
        return output if output.dtype == dtype else output.to(dtype)


def _kernel_write_kv_cache(
    kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    ops.write_kv_cache(key, value, kv_cache, slot_mapping)


def _decode(
    query: Tensor,
    kv_cache: Tensor,
    decode: PagedDecodes,
    scale: float,
    window: int,
    softcap: float,
    bf16_products: bool,
) -> Tensor:
    return ops.paged_decode_attention(
        query,
        kv_cache[0],
        kv_cache[1],
        decode.block_table,
        decode.seq_lens,
        scale,
        window,
        softcap,
        bf16_products,
    )


def _plan_decodes(metadata: AttentionMetadata) -> PagedDecodes | None:
    req_idx = metadata.decode_idx()
    if not req_idx:
        return None
    token_idx = None
    if not metadata.is_all_decode:
        token_idx = torch.tensor(
            [metadata.query_start_loc[i] for i in req_idx], device=metadata.block_table.device
        )
    return PagedDecodes(
        token_idx=token_idx,
        block_table=metadata.block_rows(req_idx).to(torch.int32).contiguous(),
        seq_lens=_int32([metadata.seq_lens[i] for i in req_idx]),
    )


def _plan_prefills(metadata: AttentionMetadata) -> PagedPrefills | None:
    req_idx = metadata.chunk_idx()
    if not req_idx:
        return None
    return PagedPrefills(
        block_table=metadata.block_rows(req_idx).to(torch.int32).contiguous(),
        query_start=_int32([metadata.query_start_loc[i] for i in req_idx]),
        query_lens=_int32([metadata.query_lens[i] for i in req_idx]),
        seq_lens=_int32([metadata.seq_lens[i] for i in req_idx]),
    )


def _int32(values: list[int]) -> Tensor:
    """A host int32 tensor, as the CPU kernels read their lengths and offsets."""
    return torch.tensor(values, dtype=torch.int32)
