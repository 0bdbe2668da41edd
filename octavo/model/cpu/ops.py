"""The CPU kernels as Python functions: one thin wrapper per torch.ops.octavo operator.

Each docstring is the operator's contract (shapes, dtypes, layouts, what is overwritten); the
C++ trusts it, so callers (the CPU backend in model/backends/cpu.py) must keep it. Conversions
happen here only where a caller may legitimately pass another dtype or layout, and only when
needed: these run once per layer per step, where a no-op call still costs microseconds. Call
them only after `build.load()` returned True. reference.py holds the plain-torch versions the
tests compare them with.
"""

from __future__ import annotations

import torch
from torch import Tensor


def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    bf16_products: bool = False,
) -> Tensor:
    """query: (num_seqs, num_heads, head_dim), read where it lies when float32 with its heads
    contiguous within a sequence (heads_contiguous: a view into a wider projection); key_cache,
    value_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous, float32 or
    bfloat16; block_table: (num_seqs, max_blocks) int32; seq_lens: (num_seqs,) int32, each >= 1.
    Returns (num_seqs, num_heads, head_dim), contiguous, in query's dtype. Query head h reads kv
    head h // (num_heads // num_kv_heads). window > 0: each query sees only its sequence's last
    `window` keys; softcap > 0: scores become softcap * tanh(score / softcap) before the softmax
    (Gemma 2). bf16_products (a bfloat16 cache only): the products in bfloat16 by AVX512-BF16
    dot products, the scaled queries and the softmax weights rounded to bfloat16 (float32 sums),
    as paged_prefill_attention's `tiles`, where the build has them for the head size (64, 128;
    bf16_tiles_available()), else as without."""
    dtype = query.dtype
    if not (dtype == torch.float32 and heads_contiguous(query)):
        query = query.float().contiguous()
    out = torch.ops.octavo.paged_decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, softcap, bf16_products
    )
    return out if dtype == torch.float32 else out.to(dtype)


def paged_prefill_attention(
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
    tiles: bool = False,
    amx: bool = True,
) -> None:
    """Causal attention for chunks of several query tokens, over keys read from the paged
    cache, written into `out`. query, out: (num_tokens, num_heads, head_dim) float32, out
    contiguous, query with its heads contiguous within a token (see heads_contiguous: a view
    into a wider projection is read in place); caches as for paged_decode_attention;
    block_table: (num_chunks, max_blocks) int32; query_start, query_lens, seq_lens:
    (num_chunks,) int32. Chunk c is rows query_start[c] .. + query_lens[c] of query; its row i
    sits at position seq_lens[c] - query_lens[c] + i and sees keys 0..that position (its own
    included: the chunk's keys must already be in the cache), under a window only keys
    position - window + 1 .. position; softcap as for paged_decode_attention. Rows outside the
    chunks are left as they are. tiles: the products in bfloat16, with the scaled queries and
    the softmax weights rounded to bfloat16 (float32 sums), on AMX tiles where the OS grants
    them (and `amx`), else by AVX512-BF16 dot products; only for a bfloat16 cache where
    bf16_tiles_available()."""
    torch.ops.octavo.paged_prefill_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start,
        query_lens,
        seq_lens,
        scale,
        window,
        softcap,
        tiles,
        amx,
    )


def packed_linear(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """x: (m, k) any float dtype; packed: from packing.pack_linear_weight of an (n, k) weight.
    Returns x @ weight^T as (m, n) float32."""
    if not (x.dtype == torch.float32 and x.is_contiguous()):
        x = x.float().contiguous()
    return torch.ops.octavo.packed_linear(x, packed, n)


def quant_linear(x: Tensor, blocks: Tensor, qtype: int, n: int) -> Tensor:
    """x: (m, k) float32 or bfloat16 (others are converted); blocks: (n, row_bytes) uint8
    contiguous, each row k weights in GGML block type `qtype` (one of formats.ggml.BLOCK_TYPES,
    k a whole number of its blocks). Returns x @ W^T as (m, n) float32, with x rounded to 8
    bits per 32 values (see quant_linear.cpp)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.octavo.quant_linear(x, blocks, int(qtype), n)


def amx_tiles_available() -> bool:
    """Whether the AMX tile kernels run here (quant_linear_tiles; tiles_linear and
    paged_prefill_attention with tiles=True take them where they can): a build for a CPU with
    AMX-BF16, on an OS that gives this process the tile registers."""
    return bool(torch.ops.octavo.amx_tiles_available())


def quant_linear_tiles(x: Tensor, blocks: Tensor, qtype: int, n: int) -> Tensor:
    """As quant_linear (the same blocks, repacked or not), for many rows of x: the weights
    dequantized to bfloat16 a few rows at a time into cache and multiplied with x rounded to
    bfloat16 by AMX tile dot products, float32 sums. Returns (m, n) float32, the float32 product
    of the bf16-rounded operands up to summation order. Only where amx_tiles_available()."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.octavo.quant_linear_tiles(x, blocks, int(qtype), n)


def bf16_tiles_available() -> bool:
    """Whether tiles_linear runs here: a build for a CPU with bfloat16 dot products
    (AVX512-BF16, which every CPU with AMX-BF16 also has)."""
    return bool(torch.ops.octavo.bf16_tiles_available())


def tiles_linear(x: Tensor, tiled: Tensor, n: int, amx: bool = True) -> Tensor:
    """x: (m, k) float32 or bfloat16 (others are converted); tiled: packing.tile_weight of a
    bfloat16 (n, k) weight. Returns x @ W^T as (m, n) float32: the float32 sums of the products
    of x rounded to bfloat16 and W (torch's bf16 GEMM's numbers up to summation order), by AMX
    tile dot products where the OS grants the tiles (and `amx`), else by AVX512-BF16's. Only
    where bf16_tiles_available()."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.octavo.tiles_linear(x, tiled, n, amx)


def quant_repacked_type(qtype: int) -> int:
    """The id of the kernels' repacked layout of GGML type `qtype` in this build (every
    type but Q2_K and Q3_K, with AVX-512), or `qtype` itself where there is none."""
    return torch.ops.octavo.quant_repacked_type(int(qtype))


def quant_repack(blocks: Tensor, qtype: int, k: int) -> Tensor:
    """blocks (as for quant_linear) in the repacked layout of quant_repacked_type(qtype): the
    same bytes rearranged so the kernel reads each chunk with a few loads (quant_linear.cpp).
    quant_linear and quant_dequantize take the result with the repacked type id."""
    return torch.ops.octavo.quant_repack(blocks, int(qtype), k)


def quant_dequantize(blocks: Tensor, qtype: int, k: int, dtype: torch.dtype) -> Tensor:
    """blocks: (rows, row_bytes) uint8 contiguous, as for quant_linear; dtype float32 or
    bfloat16. Returns the (rows, k) weights the blocks stand for (formats.ggml.dequantize)."""
    return torch.ops.octavo.quant_dequantize(blocks, int(qtype), k, dtype)


def rms_norm_(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> None:
    """In place. x: (num_tokens, hidden) float32 contiguous; weight: (hidden,) float32.
    Without residual: x <- weight * x / rms(x). With residual (same shape, contiguous):
    residual <- x + residual, then x <- weight * residual / rms(residual)."""
    has_residual = residual is not None
    torch.ops.octavo.rms_norm(x, residual if has_residual else x, weight, eps, has_residual)


def rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """In place: x <- x * cos + rotate_half(x) * sin. x: (num_tokens, num_heads, head_dim)
    float32 with unit stride in head_dim; cos, sin: (num_tokens, head_dim) float32."""
    torch.ops.octavo.rotary(x, cos.contiguous(), sin.contiguous())


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up: (num_tokens, 2 * inter) float32 or bfloat16 contiguous, gate columns first.
    Returns silu(gate) * up, (num_tokens, inter) in gate_up's dtype, computed in float32 (a
    bfloat16 result rounded once, to nearest even)."""
    return torch.ops.octavo.silu_and_mul(gate_up)


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """key, value: (num_tokens, num_kv_heads, head_dim) float32 whose heads are contiguous
    within a token (heads_contiguous); kv_cache: (2, num_blocks, block_size, num_kv_heads,
    head_dim) contiguous, float32 or bfloat16; slot_mapping: (num_tokens,) int64. Stores token
    t's key and value at slot slot_mapping[t], in the cache's dtype (bf16 rounded to nearest
    even, as torch converts)."""
    torch.ops.octavo.write_kv_cache(key, value, kv_cache, slot_mapping)


def sample_categorical(logits: Tensor, uniform: Tensor) -> Tensor:
    """One token per row of (rows, vocab) float32 logits, drawn by inverse CDF with uniform
    (rows,) or (rows, 1) float32 in [0, 1): the first token whose cumulative softmax
    probability exceeds u, as the sampler's torch path (softmax, then
    octavo.sample.ops.topk_topp.random_sample's search). A token at -inf is never picked.
    Overwrites logits (with unnormalised probabilities). Returns (rows,) int64."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return torch.ops.octavo.sample_categorical(logits, uniform.reshape(-1))


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's argmax of (rows, vocab) float32 logits, as logits.argmax(dim=1) gives it (the
    first of equal values; a NaN counts as the largest), in one vectorised pass per row, the
    rows spread over the threads (torch's is one scalar loop per row). Returns (rows,) int64."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    return torch.ops.octavo.argmax_rows(logits)


def decode_layer(
    hidden: Tensor,
    residual: Tensor,
    layer_args: tuple,
    cos: Tensor,
    sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
) -> Tensor:
    """One Llama-style decoder layer over rows that are all single-token decodes, as one call of
    the kernels above in the order the model's Python layer makes them (same results).
    hidden, residual: (num_tokens, hidden) float32 contiguous; hidden is overwritten and
    residual becomes the stream after this layer's attention. layer_args: the layer's weights
    and sizes, (input_norm, post_norm, eps, weights, kinds, rows, limits, tile_limits, parts,
    gemm_dtype, qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm, qk_norm_kind,
    residual_multiplier, num_heads, num_kv_heads, head_dim, bf16_attention, scale, window):
    the four projections' weights as parts (packed, or GGML blocks with their type id, the
    block kernel up to `limits` rows, the AMX tiles up to `tile_limits` and torch's GEMM in
    gemm_dtype above; decode_layer.cpp), optional biases, optional q/k norm weights
    (qk_norm_kind 1: per head, Qwen3; 2: over the projections, OLMoE; 0: none), the scale of
    each sublayer's output (Granite) and whether attention takes paged_decode_attention's
    bf16_products (fused.py builds them all); cos, sin: (num_tokens, head_dim) float32; the
    last three as for paged_decode_attention (cut for the layer's window: 0 or its sliding
    window), slot_mapping as for write_kv_cache.
    Returns the layer's output."""
    return torch.ops.octavo.decode_layer(
        hidden, residual, *layer_args, cos, sin, kv_cache, slot_mapping, block_table, seq_lens
    )


def moe_feed_forward(x: Tensor, moe_args: tuple) -> Tensor:
    """A mixture-of-experts feed-forward (SparseMoE without a shared expert) over decode rows
    as one call, the same kernel and torch calls in the same order as its Python forward (same
    results). moe_args: (weights, kinds, rows, limits, tile_limits, parts, gemm_dtype, top_k,
    renormalize), parts the router's count, then each expert's gate_up and down (fused.py
    binds them)."""
    return torch.ops.octavo.moe_feed_forward(x, *moe_args)


def heads_contiguous(x: Tensor) -> bool:
    """Whether each token's heads of x (..., num_heads, head_dim) lie one after another, as the
    kernels that take views into a wider projection read them."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def reads_cache_dtype(dtype: torch.dtype) -> bool:
    """Whether the paged attention kernels and write_kv_cache take a cache of this dtype."""
    return dtype in (torch.float32, torch.bfloat16)
