"""Fused CPU kernels (csrc/cpu_kernels.cpp) and the plain-torch versions they must agree with.

Operators for work where general libraries waste the CPU:
- `paged_decode_attention`: one query token per request attends over its blocks in place (no
  gather of the context into a padded copy, no padding to the longest request);
- `paged_prefill_attention`: the same for prompt chunks, causal, all chunks of a step in one
  call, each key read once for all the query heads that share it (torch's SDPA reaches ~50
  GFLOP/s here on a 256-token prompt and needs the keys gathered and the heads expanded);
- `packed_linear`: x @ W^T from a copy of W packed at load time into panels of 16 or 32
  columns that each thread streams contiguously, in bfloat16 where that is lossless (half the
  bytes; widened in registers, accumulated in float32). Far ahead of BLAS at decode sizes,
  where the weights' bytes are the cost; at prompt sizes level with BLAS or behind it, by CPU
  and shape, so the loader times both per weight shape (`calibrate_packed_max_rows`).
And five that fold a chain of small torch ops into one pass: RMSNorm with its residual add
(`rms_norm_`) and rotary embedding (`rotary_`) in place, the gated MLP's `silu_and_mul`,
`write_kv_cache` (one call for a layer's keys and values instead of a view, a conversion and an
index_copy_ for each), and the sampler's draw, `sample_categorical` (softmax, cumulative sum and
search over the vocabulary in one pass and a partial walk). Their callers keep the torch code as
the fallback, and the tests compare both. Last, `decode_layer`: a whole Llama-style decoder
layer over rows that are all decodes, as one call of the kernels above (the per-layer torch ops
and Python around them cost as much as the work at small batches).

The C++ source is compiled on first use with torch's extension builder into a cache folder
(`OCTAVO_KERNEL_CACHE`, default ~/.cache/octavo/kernels/<torch>-<source hash>), which takes
about 15 s once per machine and torch version; `python -m octavo.model.kernels` builds it ahead
of time. Without a compiler, on a non-CPU device, or with OCTAVO_DISABLE_KERNELS=1, `available()`
is False and callers use the torch reference functions below, which the tests compare against.
This module knows nothing of requests or models: tensors in, tensors out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# Rows up to which packed_linear is used; larger batches go to torch. Where the two cross
# depends on the CPU and the weight's shape (BENCHMARKS.md): level or ahead up to 2,048 rows on
# an AVX2 AMD EPYC; on an AVX-512 Intel Xeon ahead up to ~256 rows for most shapes and 5-15%
# behind MKL beyond. So the loader times each weight shape of the decoder layers
# (`calibrate_packed_max_rows`); this is the limit for the others (the output projection, which
# only sees sampled rows) and the one kept where the kernel is never slower.
PACKED_MAX_ROWS = 4096
# Calibration: the batch sizes timed, smallest first; how much faster torch must be to take a
# size (timings on a shared machine wobble by a few percent); and the time of one call beyond
# which larger sizes are not timed (a large model's weights would take minutes).
CALIBRATION_ROWS = (128, 256, 512, 1024, 2048)
CALIBRATION_MARGIN = 0.03
CALIBRATION_MAX_CALL_S = 0.05

_state: dict[str, object] = {}


# Built on the machine that runs it, so the host's vector units are fair game. -fopenmp makes
# at::parallel_for (an inline template) parallel in this library: without it the pragmas are
# ignored and every kernel runs on one thread. The OpenMP runtime is the one torch already
# loaded (same soname), so kernels and torch's own ops share one thread pool.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def _host_isa() -> str:
    """The CPU's feature flags: -march=native builds for them, so a build cache shared between
    machines (a mounted home) must not hand an AVX-512 build to a CPU without it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


def _build_dir() -> Path:
    key = " ".join(_CFLAGS + _LDFLAGS) + _host_isa()
    digest = hashlib.sha256(_SOURCE.read_bytes() + key.encode())
    digest = digest.hexdigest()[:12]
    root = os.environ.get("OCTAVO_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "octavo", "kernels"
    )
    version = torch.__version__.replace("+", "_")
    return Path(root) / f"{version}-{digest}"


def available() -> bool:
    """True once the CPU kernels are built and loaded (builds them on the first call)."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
    if os.environ.get("OCTAVO_DISABLE_KERNELS", "") not in ("", "0"):
        logger.info("CPU kernels disabled by OCTAVO_DISABLE_KERNELS; using torch ops")
        return False
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        load(
            name="octavo_cpu_kernels",
            sources=[str(_SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("built the CPU kernels in %.1f s (%s)", elapsed, build_dir)
        return True
    except Exception as exc:  # no compiler, no ninja, read-only home: fall back, say why
        logger.warning(
            "CPU kernels unavailable (%s: %s); using torch ops",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return False


# --- paged decode attention ---------------------------------------------------------------------


def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """query: (num_seqs, num_heads, head_dim); key_cache, value_cache: (num_blocks, block_size,
    num_kv_heads, head_dim), contiguous, float32 or bfloat16; block_table: (num_seqs,
    max_blocks) int32; seq_lens: (num_seqs,) int32, each >= 1. Returns (num_seqs, num_heads,
    head_dim) in query's dtype. Query head h reads kv head h // (num_heads // num_kv_heads)."""
    # Conversions only when needed: this runs once per layer per step, where a no-op call
    # still costs microseconds.
    dtype = query.dtype
    if not (dtype == torch.float32 and query.is_contiguous()):
        query = query.float().contiguous()
    out = torch.ops.octavo.paged_decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale
    )
    return out if dtype == torch.float32 else out.to(dtype)


def paged_decode_attention_reference(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """The same contract in plain torch, one sequence at a time, softmax in float32."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), keys) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values).to(query.dtype)
    return out


# --- paged prefill attention --------------------------------------------------------------------


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
) -> None:
    """Causal attention for chunks of several query tokens, over keys read from the paged
    cache, written into `out`. query, out: (num_tokens, num_heads, head_dim) float32, out
    contiguous, query with its heads contiguous within a token (see heads_contiguous: a view
    into a wider projection is read in place); caches as for paged_decode_attention;
    block_table: (num_chunks, max_blocks) int32; query_start, query_lens, seq_lens:
    (num_chunks,) int32. Chunk c is rows query_start[c] .. + query_lens[c] of query; its row i
    sits at position seq_lens[c] - query_lens[c] + i and sees keys 0..that position (its own
    included: the chunk's keys must already be in the cache). Rows outside the chunks are left
    as they are."""
    torch.ops.octavo.paged_prefill_attention(
        out, query, key_cache, value_cache, block_table, query_start, query_lens, seq_lens, scale
    )


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
) -> None:
    """The same contract in plain torch, one chunk at a time, softmax in float32."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    chunks = zip(query_start.tolist(), query_lens.tolist(), seq_lens.tolist(), strict=True)
    for c, (start, q_len, seq_len) in enumerate(chunks):
        blocks = block_table[c, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start : start + q_len].float(), keys) * scale
        positions = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        scores.masked_fill_(torch.arange(seq_len).unsqueeze(0) > positions, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def reads_cache_dtype(dtype: torch.dtype) -> bool:
    """Whether paged_decode_attention, paged_prefill_attention and write_kv_cache take a cache
    of this dtype."""
    return dtype in (torch.float32, torch.bfloat16)


# --- packed linear ------------------------------------------------------------------------------


def panel_width() -> int:
    """Output columns per packed panel: two of the kernel's vectors (32 where the build has
    AVX-512, else 16); packed weights must be laid out for the kernel that reads them."""
    return int(torch.ops.octavo.packed_panel()) if available() else 16


def _bf16_panel_order(width: int) -> list[int]:
    """bf16 panels interleave their halves (0, h, 1, h + 1, ...): each 32-bit word holds column
    i and column h + i, so one load widens to two float32 vectors with a shift and a mask."""
    half = width // 2
    return [j for i in range(half) for j in (i, half + i)]


def packed_layout(
    weight: Tensor,
    allow_bf16: bool = True,
) -> tuple[tuple[int, int, int], torch.dtype] | None:
    """The (shape, dtype) `pack_linear_weight` gives this weight, or None where it gives none:
    (ceil(n / w), k, w) for an (n, k) weight, w = panel_width(); bfloat16 (half the bytes) when
    every value is exactly a bf16 number, which keeps the results of float32 compute unchanged,
    unless `allow_bf16` is False; else float32. None for other dtypes or devices."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    n, k = weight.shape
    width = panel_width()
    exact = allow_bf16 and (
        weight.dtype == torch.bfloat16 or torch.equal(weight.to(torch.bfloat16).float(), weight)
    )
    return (-(-n // width), k, width), torch.bfloat16 if exact else torch.float32


def pack_linear_weight(
    weight: Tensor,
    allow_bf16: bool = True,
    out: Tensor | None = None,
) -> Tensor | None:
    """The weight (n, k) of a CPU linear layer packed for `packed_linear`, laid out as
    `packed_layout` says: panel p holds output columns wp..wp+w-1 (zero rows pad n). Written
    into `out` if given (a tensor of that layout), else into a new tensor; None where
    `packed_layout` is None."""
    if out is None:
        layout = packed_layout(weight, allow_bf16)
        if layout is None:
            return None
        out = torch.empty(layout[0], dtype=layout[1])
    weight = weight.detach()
    num_panels, k, width = out.shape
    padded = weight.new_zeros(num_panels * width, k, dtype=out.dtype)
    padded[: weight.shape[0]] = weight
    panels = padded.view(num_panels, width, k)
    if out.dtype == torch.bfloat16:
        panels = panels[:, _bf16_panel_order(width)]
    return out.copy_(panels.transpose(1, 2))


def unpack_linear_weight(packed: Tensor, n: int) -> Tensor:
    """The (n, k) weight a packed one holds, in the packed dtype (the inverse of packing)."""
    panels = packed.transpose(1, 2)
    if packed.dtype == torch.bfloat16:
        panels = panels[:, torch.argsort(torch.tensor(_bf16_panel_order(packed.shape[2])))]
    return panels.reshape(-1, packed.shape[1])[:n]


def packed_linear(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """x: (m, k) any float dtype; packed: from `pack_linear_weight` of an (n, k) weight. Returns
    x @ weight^T as (m, n) float32."""
    if not (x.dtype == torch.float32 and x.is_contiguous()):
        x = x.float().contiguous()
    return torch.ops.octavo.packed_linear(x, packed, n)


def packed_linear_reference(x: Tensor, packed: Tensor, n: int) -> Tensor:
    return F.linear(x.float(), unpack_linear_weight(packed, n).float())


def choose_packed_max_rows(timings: list[tuple[int, float, float]], margin: float) -> int:
    """The row limit for packed_linear from (rows, packed seconds, torch seconds), ascending in
    rows: the largest size before the first at which torch's GEMM is faster by more than
    `margin`; PACKED_MAX_ROWS if it never is. Below the smallest size timed the kernel is kept
    (half of it), as decode-sized batches are what it is for."""
    limit = 0
    for rows, packed_s, torch_s in timings:
        if _torch_is_faster(packed_s, torch_s, margin):
            return limit or rows // 2
        limit = rows
    return PACKED_MAX_ROWS


def _torch_is_faster(packed_s: float, torch_s: float, margin: float = CALIBRATION_MARGIN) -> bool:
    return torch_s * (1 + margin) < packed_s


def time_interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each named function over `repeats` rounds that run them all in
    turn, so that the machine's drift hits every one alike (one warm-up call each first)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(max(repeats, 1)):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _time_matmuls(weight: Tensor, packed: Tensor, rows: int, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of packed_linear and of F.linear for `rows` rows, alternated so
    that a slow moment of the machine hits both."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    n = weight.shape[0]
    times = time_interleaved(
        {"packed": lambda: packed_linear(x, packed, n), "torch": lambda: F.linear(x, weight)},
        repeats,
    )
    return min(times["packed"]), min(times["torch"])


def calibrate_packed_max_rows(weight: Tensor, packed: Tensor, repeats: int = 5) -> int:
    """The row limit up to which `linear()` should use packed_linear for this weight (a CPU
    compute weight, as torch's GEMM gets it, and its packed copy) on this machine: both timed
    at CALIBRATION_ROWS, smallest first, until torch's is faster (in two timings running) or
    one call takes longer than CALIBRATION_MAX_CALL_S, then `choose_packed_max_rows`. Kept per
    weight shape for the process (layers of one shape are timed once). OCTAVO_PACKED_MAX_ROWS,
    where set, is returned instead of timing. ~0.3 s for each of the embedded model's four
    shapes on two cores."""
    override = os.environ.get("OCTAVO_PACKED_MAX_ROWS", "")
    if override:
        return int(override)
    key = (
        "packed_max_rows",
        tuple(weight.shape),
        weight.dtype,
        packed.dtype,
        torch.get_num_threads(),
    )
    if key not in _state:
        timings = []
        for rows in CALIBRATION_ROWS:
            packed_s, torch_s = _time_matmuls(weight, packed, rows, repeats)
            crossed = _torch_is_faster(packed_s, torch_s)
            if crossed:
                # A busy moment can fake a crossing: the second timing decides.
                packed_s, torch_s = _time_matmuls(weight, packed, rows, repeats)
                crossed = _torch_is_faster(packed_s, torch_s)
            timings.append((rows, packed_s, torch_s))
            if crossed or packed_s > CALIBRATION_MAX_CALL_S:
                break
        _state[key] = choose_packed_max_rows(timings, CALIBRATION_MARGIN)
        logger.info(
            "%d x %d weight: packed matmul up to %d rows, torch's GEMM above (%s)",
            weight.shape[0],
            weight.shape[1],
            _state[key],
            ", ".join(f"{rows} rows {p * 1e3:.2f} vs {t * 1e3:.2f} ms" for rows, p, t in timings),
        )
    return int(_state[key])


def use_packed_linear(x: Tensor, packed: Tensor | None, max_rows: int | None = None) -> bool:
    """Whether the kernel takes this matmul: at most `max_rows` rows (PACKED_MAX_ROWS if None)
    and a packed weight (only CPU weights get one)."""
    limit = PACKED_MAX_ROWS if max_rows is None else max_rows
    return packed is not None and x.ndim == 2 and x.shape[0] <= limit and available()


# --- fused elementwise ----------------------------------------------------------------------------


def use_fused_elementwise(x: Tensor) -> bool:
    """Whether rms_norm_ / rotary_ can take x: float32 on a CPU with the kernels built."""
    return x.dtype == torch.float32 and x.is_cpu and available()


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
    """gate_up: (num_tokens, 2 * inter) float32 contiguous, gate columns first. Returns
    silu(gate) * up, (num_tokens, inter)."""
    return torch.ops.octavo.silu_and_mul(gate_up)


def silu_and_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- sampling -------------------------------------------------------------------------------------


def vectorized() -> bool:
    """Whether the kernels are built with their AVX2 (or AVX-512) paths: without them they run
    plain loops, which for sample_categorical are slower than torch's vectorised ops."""
    return available() and bool(torch.ops.octavo.vectorized())


def sample_categorical(logits: Tensor, uniform: Tensor) -> Tensor:
    """One token per row of (rows, vocab) float32 logits (contiguous), drawn by inverse CDF
    with uniform (rows,) or (rows, 1) float32 in [0, 1): the first token whose cumulative
    softmax probability exceeds u, as the sampler's torch path (softmax, then
    octavo.sample.ops.topk_topp.random_sample's search). A token at -inf is never picked.
    Overwrites logits (with unnormalised probabilities). Returns (rows,) int64."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return torch.ops.octavo.sample_categorical(logits, uniform.reshape(-1))


def use_kv_cache_write(key: Tensor, value: Tensor, kv_cache: Tensor) -> bool:
    """Whether write_kv_cache can take these: float32 keys and values on a CPU whose heads are
    contiguous within a token, and a contiguous float32 or bfloat16 cache."""
    return (
        key.dtype == value.dtype == torch.float32
        and reads_cache_dtype(kv_cache.dtype)
        and key.is_cpu
        and heads_contiguous(key)
        and heads_contiguous(value)
        and kv_cache.is_contiguous()
        and available()
    )


def heads_contiguous(x: Tensor) -> bool:
    """Whether each token's heads of x (..., num_heads, head_dim) lie one after another, as the
    kernels that take views into a wider projection read them."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """key, value: (num_tokens, num_kv_heads, head_dim) float32 (see use_kv_cache_write);
    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim); slot_mapping: (num_tokens,)
    int64. Stores token t's key and value at slot slot_mapping[t], in the cache's dtype."""
    torch.ops.octavo.write_kv_cache(key, value, kv_cache, slot_mapping)


# --- a whole decoder layer for decode rows ------------------------------------------------------


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
    and sizes, (input_norm, post_norm, eps, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias,
    down, down_bias, num_heads, num_kv_heads, head_dim, intermediate_size, scale) with packed
    weights and optional biases; cos, sin: (num_tokens, head_dim) float32; the last three as
    for paged_decode_attention, slot_mapping as for write_kv_cache. Returns the layer's output.
    """
    return torch.ops.octavo.decode_layer(
        hidden, residual, *layer_args, cos, sin, kv_cache, slot_mapping, block_table, seq_lens
    )
