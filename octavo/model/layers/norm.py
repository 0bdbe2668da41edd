"""RMSNorm with an optional fused residual add; the arithmetic is the backend's LayerOps.

Owns normalisation's parameters only; it must not know about attention or caches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model.backends.base import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size))  # (hidden,)

    def forward(self, x: Tensor) -> Tensor:
        """(num_tokens, hidden) -> the same shape, normalised."""
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the decoder's residual add fused with the next
        norm, so each layer hands on the un-normalised sum as the new residual stream. Both
        inputs are consumed: their storage may be reused for the results."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class HeadRMSNorm(RMSNorm):
    """RMSNorm over head_dim applied to every head of (num_tokens, num_heads, head_dim), the
    input a view into a wider projection (Qwen3's q_norm / k_norm)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm_heads(x, self.weight, self.eps)
