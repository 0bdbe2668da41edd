"""Quantizing float weights to the K-quant block types Q4_K, Q5_K and Q6_K, in plain torch.

The `gguf` package quantizes only the 32-weight types; these are octavo's own. Each super-block
of 256 weights is fitted in two stages, as the format asks:

1. per sub-block (32 weights for Q4_K/Q5_K, 16 for Q6_K) a float scale (and for Q4_K/Q5_K a
   minimum), by a weighted least-squares fit over a few candidate grids: each candidate rounds
   the sub-block onto the integer grid, the scale and minimum that best map those integers back
   onto x (in weighted squared error) are solved in closed form, and the best candidate stays.
   The error weights favour the large values of x (w = rms(x) + |x| for the 4/5-bit types,
   w = x^2 for Q6_K), which dominate a matrix product;
2. the sub-block scales (and minimums) are themselves quantized, to 6 bits (Q4_K/Q5_K) or a
   signed 8 (Q6_K), against one float16 factor per super-block, and every weight is rounded
   again with the scales as stored.

`dequantize` in ggml.py (equal to gguf's numpy dequantization) reads the result; llama.cpp
loads a GGUF of these blocks (octavo convert --outtype q4_k_m). The rounding is not llama.cpp's
bit for bit; its error is of the same size (tests/model/test_quantized.py states the bound).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Candidate grids per sub-block: the integer range stretched by these fractions of a step.
_STRETCH = torch.linspace(-1.0, 1.0, 21).tolist()
# Super-blocks fitted at once (bounds the working memory: ~100 bytes per weight).
_CHUNK = 4096


def quantize_q4_k(weight: Tensor) -> Tensor:
    """(n, k) float, k a multiple of 256 -> (n, k / 256 * 144) uint8 Q4_K blocks."""
    return _by_chunks(weight, 144, lambda x: _asymmetric(x, 15))


def quantize_q5_k(weight: Tensor) -> Tensor:
    """(n, k) float, k a multiple of 256 -> (n, k / 256 * 176) uint8 Q5_K blocks."""
    return _by_chunks(weight, 176, lambda x: _asymmetric(x, 31))


def quantize_q6_k(weight: Tensor) -> Tensor:
    """(n, k) float, k a multiple of 256 -> (n, k / 256 * 210) uint8 Q6_K blocks."""
    return _by_chunks(weight, 210, _symmetric)


def _by_chunks(weight: Tensor, type_size: int, fit) -> Tensor:
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"K-quant rows hold whole blocks of 256; got {k}.")
    supers = weight.detach().to(torch.float32).reshape(-1, 256)
    out = torch.empty(supers.shape[0], type_size, dtype=torch.uint8)
    for start in range(0, supers.shape[0], _CHUNK):
        out[start : start + _CHUNK] = fit(supers[start : start + _CHUNK].cpu())
    return out.reshape(n, -1)


def _fp16(values: Tensor) -> tuple[Tensor, Tensor]:
    """values (nb,) as stored: (their float16 bytes (nb, 2), the float16 values as float32)."""
    half = values.to(torch.float16)
    return half.view(torch.uint8).reshape(-1, 2), half.float()


def _asymmetric(x: Tensor, nmax: int) -> Tensor:
    """Q4_K (nmax 15) or Q5_K (nmax 31) blocks of x (nb, 256): w = d * sc * q - dmin * mn."""
    nb = x.shape[0]
    sub = x.view(nb, 8, 32)
    weights = sub.pow(2).mean(-1, keepdim=True).sqrt() + sub.abs()
    low = sub.amin(-1, keepdim=True).clamp(max=0)
    span = sub.amax(-1, keepdim=True) - low
    live = span > 0
    safe_span = torch.where(live, span, torch.ones_like(span))
    sum_w = weights.sum(-1, keepdim=True)
    sum_x = (weights * sub).sum(-1, keepdim=True)
    # The plain grid first (scale span / nmax from the minimum), then the stretched ones.
    best_scale, best_min = span / nmax, low
    levels = torch.clamp(torch.round((sub - low) / safe_span * nmax), 0, nmax)
    best_error = (weights * (best_scale * levels + best_min - sub).pow(2)).sum(-1, keepdim=True)
    for stretch in _STRETCH:
        levels = torch.clamp(torch.round((sub - low) * ((nmax + stretch) / safe_span)), 0, nmax)
        sum_l = (weights * levels).sum(-1, keepdim=True)
        sum_l2 = (weights * levels * levels).sum(-1, keepdim=True)
        sum_xl = (weights * levels * sub).sum(-1, keepdim=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = torch.where(ok, det, torch.ones_like(det))
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        # The format's minimum only lowers (w = scale * q - m with m >= 0): refit without it.
        positive = minimum > 0
        scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), scale)
        minimum = torch.where(positive, torch.zeros_like(minimum), minimum)
        error = (weights * (scale * levels + minimum - sub).pow(2)).sum(-1, keepdim=True)
        better = ok & (error < best_error)
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, minimum, best_min)
    scales = torch.where(live, best_scale, torch.zeros_like(best_scale)).squeeze(-1).clamp(min=0)
    mins = (-torch.where(live, best_min, low)).squeeze(-1).clamp(min=0)  # (nb, 8), >= 0
    d_bytes, d = _fp16(scales.amax(-1) / 63)
    dmin_bytes, dmin = _fp16(mins.amax(-1) / 63)
    sc = _levels(scales, d, 63)
    mn = _levels(mins, dmin, 63)
    step = d.unsqueeze(-1) * sc.float()  # (nb, 8): the stored scales
    offset = dmin.unsqueeze(-1) * mn.float()
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((sub + offset.unsqueeze(-1)) / safe_step.unsqueeze(-1)).clamp(0, nmax)
    q = torch.where(step.unsqueeze(-1) > 0, q, torch.zeros_like(q)).to(torch.uint8).view(nb, 256)
    packed_scales = _pack_scales_k4(sc, mn)
    # Low nibbles: weight 64j + l in byte 32j + l's low nibble, 64j + 32 + l in its high one.
    pairs = q.view(nb, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(nb, 128)
    parts = [d_bytes, dmin_bytes, packed_scales]
    if nmax == 31:
        # The fifth bit of weight 32i + l at bit i of qh[l].
        fifth = (q.view(nb, 8, 32) >> 4) & 1
        shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        parts.append((fifth << shifts).sum(1, dtype=torch.int32).to(torch.uint8))
    parts.append(qs)
    return torch.cat(parts, dim=1)


def _levels(values: Tensor, factor: Tensor, top: int) -> Tensor:
    """values (nb, s) >= 0 as integers 0..top of factor (nb,) (0 where the factor is)."""
    safe = torch.where(factor > 0, factor, torch.ones_like(factor)).unsqueeze(-1)
    levels = torch.round(values / safe).clamp(0, top)
    return torch.where(factor.unsqueeze(-1) > 0, levels, torch.zeros_like(levels)).to(torch.uint8)


def _pack_scales_k4(sc: Tensor, mn: Tensor) -> Tensor:
    """Eight 6-bit scales and minimums (nb, 8) each as Q4_K's 12 bytes: bytes 0-3 scales 0-3
    and 4-7 minimums 0-3 (low 6 bits), their top two bits the high bits of scales / minimums
    4-7, whose low nibbles are bytes 8-11 (scale low, minimum high)."""
    low, high = sc[:, :4], sc[:, 4:]
    mlow, mhigh = mn[:, :4], mn[:, 4:]
    first = low | ((high >> 4) << 6)
    second = mlow | ((mhigh >> 4) << 6)
    third = (high & 0xF) | ((mhigh & 0xF) << 4)
    return torch.cat([first, second, third], dim=1)


def _symmetric(x: Tensor) -> Tensor:
    """Q6_K blocks of x (nb, 256): w = d * sc * (q - 32), sc a signed byte per 16 weights."""
    nb = x.shape[0]
    sub = x.view(nb, 16, 16)
    weights = sub * sub
    # The value of largest magnitude, with its sign: mapped onto -32, the grid's longer side.
    extreme = torch.gather(sub, -1, sub.abs().argmax(-1, keepdim=True))
    live = extreme != 0
    safe_extreme = torch.where(live, extreme, torch.ones_like(extreme))
    best_scale = torch.zeros_like(extreme)
    best_error = torch.full_like(extreme, float("inf"))
    for stretch in [0.0, *_STRETCH]:
        levels = torch.clamp(torch.round(sub * (-(32 + stretch) / safe_extreme)), -32, 31)
        sum_l2 = (weights * levels * levels).sum(-1, keepdim=True)
        sum_xl = (weights * levels * sub).sum(-1, keepdim=True)
        scale = sum_xl / sum_l2.clamp(min=1e-30)
        error = (weights * (scale * levels - sub).pow(2)).sum(-1, keepdim=True)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
    scales = torch.where(live, best_scale, torch.zeros_like(best_scale)).squeeze(-1)  # (nb, 16)
    d_bytes, d = _fp16(scales.abs().amax(-1) / 127)
    safe_d = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    sc = torch.round(scales / safe_d).clamp(-127, 127)
    sc = torch.where(d.unsqueeze(-1) > 0, sc, torch.zeros_like(sc))
    step = d.unsqueeze(-1) * sc
    safe_step = torch.where(step != 0, step, torch.ones_like(step)).unsqueeze(-1)
    q = torch.round(sub / safe_step).clamp(-32, 31) + 32
    q = torch.where(step.unsqueeze(-1) != 0, q, torch.full_like(q, 32)).to(torch.uint8)
    # Weight 128h + 32i + l: low nibble in ql[64h + 32(i % 2) + l] (i < 2 low, else high),
    # bits 4-5 at bits 2i of qh[32h + l].
    q = q.view(nb, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)).reshape(nb, 128)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 4, 1)
    qh = (((q >> 4) & 3) << shifts).sum(2, dtype=torch.int32).to(torch.uint8).reshape(nb, 64)
    scale_bytes = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scale_bytes, d_bytes], dim=1)
