"""Float weights reordered once into oneDNN's own blocked layout for its matmul.

torch's GEMM on a CPU with bfloat16 weights is oneDNN's, and it is given the weight as a plain
(n, k) matrix: every call reorders it into the blocked layout the kernel reads (on AMX, pairs
of k interleaved in tiles) before multiplying. For a prompt chunk of a few hundred rows that
reorder is a fifth of the call, and at 32 rows close to half. oneDNN's linear operator in
torch (the one torch's own compiler uses after freezing a model) takes a weight reordered once
instead; the products are oneDNN's inner product over the same values, so they round as
torch's GEMM does. Used where it is measured faster (model/cpu/calibration.py); the plain
weight stays for everything else that reads it (an embedding lookup, the packed panels).
"""

from __future__ import annotations

import torch
from torch import Tensor


def available(weight: Tensor) -> bool:
    """Whether `weight` can be reordered for oneDNN's linear here: a bfloat16 (n, k) CPU
    tensor, torch built with oneDNN, and a CPU whose bfloat16 oneDNN supports."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def prepack(weight: Tensor) -> Tensor:
    """The (n, k) weight in oneDNN's blocked layout (an opaque mkldnn tensor of the same shape
    and dtype; a copy: the plain weight is unchanged)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (m, k) in the packed weight's dtype -> x @ W^T + bias, (m, n) in that dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def nbytes(packed: Tensor) -> int:
    """Bytes of the reordered copy (its values; oneDNN may pad a few more)."""
    return packed.numel() * packed.element_size()
