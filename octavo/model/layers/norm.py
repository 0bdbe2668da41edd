"""RMSNorm with an optional fused residual add, numerically as Hugging Face computes it.

Owns normalisation only; it must not know about attention or caches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))  # (hidden,)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and kernels.use_fused_elementwise(x) and self.weight.dtype == x.dtype:
            out = x.clone()
            kernels.rms_norm_(out, self.weight, self.eps)
            return out
        # The mean of squares is taken in float32 whatever the input dtype (bf16 would lose the
        # small terms); the result goes back to the input dtype before the weight, as in HF.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the decoder's residual add fused with the next
        norm, so each layer hands on the un-normalised sum as the new residual stream. Both
        inputs are consumed: their storage may be reused for the results."""
        if (
            x.dim() == 2
            and kernels.use_fused_elementwise(x)
            and x.is_contiguous()
            and residual.is_contiguous()
            and residual.dtype == x.dtype == self.weight.dtype
        ):
            kernels.rms_norm_(x, self.weight, self.eps, residual)
            return x, residual
        x = x + residual
        return self.forward(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
