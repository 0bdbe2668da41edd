"""TorchOps: the layer ops in plain torch, numerically as Hugging Face computes them.

The reference every faster LayerOps is tested against, and the ops of any device or dtype the
kernels do not cover (GPUs, bfloat16 compute on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.backends.base import LayerOps
from octavo.model.layers.rotary import apply_rotary


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The mean of squares is taken in float32 whatever the input dtype (bf16 would lose the
    # small terms); the result goes back to the input dtype before the weight, as in HF.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class TorchOps(LayerOps):
    name = "torch"

    _ACTIVATIONS: ClassVar[dict[str, Callable[[Tensor], Tensor]]] = {
        "silu": silu_and_mul,
        "gelu_pytorch_tanh": gelu_tanh_and_mul,
    }

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        x = x + residual
        return self.rms_norm(x, weight, eps), x

    def rms_norm_heads(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotary(x, cos, sin)

    def act_and_mul(self, act: str) -> Callable[[Tensor], Tensor]:
        if act not in self._ACTIVATIONS:
            raise ValueError(
                f"hidden_act={act!r} is not supported (supported: {', '.join(self._ACTIVATIONS)})."
            )
        return self._ACTIVATIONS[act]
