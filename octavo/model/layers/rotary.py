"""Rotary position embedding with Hugging Face semantics (rotate-half layout).

Owns the inverse frequencies for the supported `rope_type`s (default, linear, llama3, longrope)
and the cos/sin of a batch of positions. It must not know about requests or caches: positions
come in as a flat tensor, one per token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> Tensor:
    """(head_dim // 2,) float32 on the CPU: the angle per position of each rotated pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Stretching positions by `factor` equals shrinking every frequency by it.
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "longrope":  # the short factors; RotaryEmbedding adds the long ones
        return _longrope_inv_freq(head_dim, rope_theta, rope_scaling["short_factor"])
    raise ValueError(f"rope_type={rope_type!r} is not supported.")


def _longrope_inv_freq(head_dim: int, rope_theta: float, factors: list[float]) -> Tensor:
    """LongRoPE's frequencies, each divided by its factor (rounded as transformers does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * rope_theta**exponents)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1's rule: wavelengths longer than the original context / low_freq_factor are
    slowed by `factor`, shorter than context / high_freq_factor kept, and the band between
    blends the two linearly in (context / wavelength)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    is_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(is_band, blended, scaled)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (num_tokens, num_heads, head_dim); cos, sin: (num_tokens, head_dim) in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin for a flat batch of positions, computed once per forward and shared by layers.

    The inverse frequencies are a plain attribute, not a buffer: the loader builds models on the
    meta device and materialises them with `to_empty`, which would leave a buffer uninitialised.
    They are moved to the positions' device on first use.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        # LongRoPE (Phi-3): positions from original_max_position_embeddings on take the long
        # factors' frequencies, earlier ones the short factors', and cos and sin are scaled by
        # attention_factor. (transformers instead recomputes a sequence's whole cache with the
        # long factors once it outgrows that length; cached keys here keep their rotation.)
        self._long_from = 0
        self._long_inv_freq = None
        self._attention_factor = 1.0
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            long = rope_scaling["long_factor"]
            self._long_inv_freq = _longrope_inv_freq(head_dim, rope_theta, long)
            self._long_from = rope_scaling["original_max_position_embeddings"]
            self._attention_factor = rope_scaling["attention_factor"]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: (num_tokens,) int64 -> cos, sin: (num_tokens, head_dim) in `dtype`."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        # Angles in float32 (bf16 positions lose integers above 256), cast like HF afterwards.
        freqs = positions.float().unsqueeze(1) * self._inv_freq.unsqueeze(0)  # (num_tokens, d/2)
        if self._long_inv_freq is not None:
            if self._long_inv_freq.device != positions.device:
                self._long_inv_freq = self._long_inv_freq.to(positions.device)
            long = positions.float().unsqueeze(1) * self._long_inv_freq.unsqueeze(0)
            freqs = torch.where((positions >= self._long_from).unsqueeze(1), long, freqs)
        angles = torch.cat((freqs, freqs), dim=-1)  # (num_tokens, head_dim)
        cos, sin = angles.cos(), angles.sin()
        if self._attention_factor != 1.0:
            cos, sin = cos * self._attention_factor, sin * self._attention_factor
        return cos.to(dtype), sin.to(dtype)
