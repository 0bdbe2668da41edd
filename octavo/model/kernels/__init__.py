"""Fused CPU kernels (csrc/cpu_kernels.cpp) and the plain-torch versions they must agree with.

Two operators for decode-sized work where general libraries waste the CPU:
- `paged_decode_attention`: one query token per request attends over its blocks in place (no
  gather of the context into a padded copy, no padding to the longest request);
- `small_m_linear`: x @ W^T for a few rows, reading each weight once for all rows; the weight
  may be float32 or bfloat16 (half the bytes; widened in registers, accumulated in float32).
And two that fold a chain of elementwise torch ops into one pass, in place: RMSNorm with its
residual add (`rms_norm_`) and rotary embedding (`rotary_`). Their callers keep the torch code
as the fallback, and the tests compare both.

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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# Rows up to which small_m_linear beats the BLAS GEMM on a CPU (measured: BENCHMARKS.md).
SMALL_M_MAX_ROWS = 8

_state: dict[str, object] = {}


def _build_dir() -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
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
            # Built on the machine that runs it, so the host's vector units are fair game.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"],
            is_python_module=False,
            verbose=False,
        )
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("built the CPU kernels in %.1f s (%s)", elapsed, build_dir)
        return True
    except Exception as exc:  # no compiler, no ninja, read-only home: fall back, say why
        logger.warning("CPU kernels unavailable (%s: %s); using torch ops", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return False


# --- paged decode attention ---------------------------------------------------------------------


def paged_decode_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
    seq_lens: Tensor, scale: float,
) -> Tensor:
    """query: (num_seqs, num_heads, head_dim); key_cache, value_cache: (num_blocks, block_size,
    num_kv_heads, head_dim), contiguous, float32 or bfloat16; block_table: (num_seqs,
    max_blocks) int32; seq_lens: (num_seqs,) int32, each >= 1. Returns (num_seqs, num_heads,
    head_dim) in query's dtype. Query head h reads kv head h // (num_heads // num_kv_heads)."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    torch.ops.octavo.paged_decode_attention(
        out, query.float().contiguous(), key_cache, value_cache, block_table, seq_lens, scale
    )
    return out.to(query.dtype)


def paged_decode_attention_reference(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
    seq_lens: Tensor, scale: float,
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


# --- small-M linear -----------------------------------------------------------------------------


def small_m_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x: (m, k) any float dtype; weight: (n, k) float32 or bfloat16, contiguous. Returns
    x @ weight^T as (m, n) float32."""
    x = x.float().contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    torch.ops.octavo.small_m_linear(out, x, weight)
    return out


def small_m_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x.float(), weight.float())


def use_small_m_linear(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes this matmul: a CPU tensor with few rows and a bf16 weight."""
    # Only bf16 weights: with float32 ones MKL's GEMV/GEMM is as fast or faster here (measured
    # on a quiet machine); the kernel's gain is reading half the bytes.
    return (
        x.dim() == 2
        and x.shape[0] <= SMALL_M_MAX_ROWS
        and x.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and available()
    )


# --- fused elementwise ----------------------------------------------------------------------------


def use_fused_elementwise(x: Tensor) -> bool:
    """Whether rms_norm_ / rotary_ can take x: float32 on a CPU with the kernels built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


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
