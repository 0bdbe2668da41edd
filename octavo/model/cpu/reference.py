"""Plain-torch versions of the CPU kernels, with the same contracts as ops.py.

They are what the tests hold the kernels to, written to be obviously right rather than fast
(one sequence or chunk at a time, softmax in float32). The layer ops (norms, rotary) have theirs
in model/backends/torch_ops.py, which is also the backend used where the kernels are not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.backends.reference import attend
from octavo.model.cpu.packing import unpack_linear_weight


def paged_decode_attention_reference(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """ops.paged_decode_attention's contract, one sequence at a time."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        out[i] = attend(query[i : i + 1], keys, values, scale, window, softcap)[0].to(query.dtype)
    return out


def paged_prefill_attention_reference(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """ops.paged_prefill_attention's contract, one chunk at a time."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    chunks = zip(query_start.tolist(), query_lens.tolist(), seq_lens.tolist(), strict=True)
    for c, (start, q_len, seq_len) in enumerate(chunks):
        blocks = block_table[c, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        chunk = query[start : start + q_len]
        out[start : start + q_len] = attend(chunk, keys, values, scale, window, softcap)


def packed_linear_reference(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """ops.packed_linear's contract: the unpacked weight through torch's matmul."""
    return F.linear(x.float(), unpack_linear_weight(packed, n).float())


def silu_and_mul_reference(gate_up: Tensor) -> Tensor:
    """ops.silu_and_mul's contract."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
