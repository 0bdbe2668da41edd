"""GatedMLP: down(act(gate(x)) * up(x)), the feed-forward of the Llama family.

gate and up are packed into one matmul (`gate_up_proj`, shards "gate" then "up"); the
activation-and-multiply is the backend's. Owns nothing but the feed-forward; it must not know
about attention or checkpoint names beyond its own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model.backends.base import LayerOps
from octavo.model.layers.linear import Linear, PackedLinear
from octavo.model.parallel import TRIVIAL, TPGroup


class GatedMLP(nn.Module):
    # The ranks its columns are split over (model/parallel.py); down_proj's outputs are summed.
    tp: TPGroup = TRIVIAL

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, act: str, ops: LayerOps
    ) -> None:
        """`act`: HF's hidden_act name; the backend's function for it is looked up here, once
        (ValueError for one it does not have)."""
        super().__init__()
        self.gate_up_proj = PackedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul = ops.act_and_mul(act)
        self.bias = bias
        self.act_rounds_once = ops.act_and_mul_rounds_once(act)

    def forward(self, x: Tensor) -> Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden)."""
        dtype = self._gemm_dtype(x)
        if dtype is not None:
            # Both GEMMs round their inputs to `dtype` and the activation rounds once to it
            # from float32: the same numbers as below, without converting gate_up to x's dtype
            # and the activation's result back (a prompt's widest tensors).
            gate_up = self.gate_up_proj(x.to(dtype))
            return self.tp.all_reduce(self.down_proj(self.act_and_mul(gate_up)).to(x.dtype))
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * inter)
        return self.tp.all_reduce(self.down_proj(self.act_and_mul(gate_up)))

    def _gemm_dtype(self, x: Tensor) -> torch.dtype | None:
        """The bfloat16 both projections' GEMMs round x to for this many rows, where keeping
        the activations in it between them changes no result; else None."""
        if self.bias or not self.act_rounds_once or x.dtype != torch.float32:
            return None
        rows = x.shape[0]
        dtype = self.gate_up_proj.weight_format.gemm_input_dtype(rows)
        if dtype != torch.bfloat16 or self.down_proj.weight_format.gemm_input_dtype(rows) != dtype:
            return None
        return dtype
