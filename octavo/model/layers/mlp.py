"""GatedMLP: down(silu(gate(x)) * up(x)), the feed-forward of Llama, Qwen2 and Qwen3.

gate and up are packed into one matmul (`gate_up_proj`, shards "gate" then "up"). Owns nothing
but the feed-forward; it must not know about attention or checkpoint names beyond its own.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from octavo.model import kernels
from octavo.model.layers.linear import Linear, PackedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden)."""
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * inter)
        if kernels.use_fused_elementwise(gate_up) and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = self.gate_up_proj.split_output(gate_up)
        return self.down_proj(F.silu(gate) * up)
