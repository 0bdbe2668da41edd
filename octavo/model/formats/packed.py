"""PackedWeight: a float weight with a copy packed for the CPU's packed-panel matmul kernel.

BLAS GEMMs run far below memory bandwidth at decode sizes; the packed kernel streams each
panel contiguously (model/cpu/packing.py has the layout). Up to `max_rows` rows (measured when
the model is loaded, model/cpu/calibration.py) the kernel takes the matmul, above it torch's
GEMM on the float weight, which is kept for that. The packed copy is bfloat16 where every value
of the weight is an exact bf16 number, so its results equal float32 compute's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.model.cpu import ops
from octavo.model.formats.base import DenseWeight


class PackedWeight(DenseWeight):
    def __init__(self, weight: Tensor, packed: Tensor, max_rows: int) -> None:
        super().__init__(weight)
        self.packed = packed  # (ceil(n / w), k, w)
        self.max_rows = max_rows
        self.name = f"packed-{str(packed.dtype).removeprefix('torch.')}"

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] > self.max_rows:
            return super().matmul(x, bias)
        out = ops.packed_linear(x, self.packed, self.weight.shape[0])
        if bias is not None:
            out += bias
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def gemm_input_dtype(self, rows: int) -> torch.dtype | None:
        return None if rows <= self.max_rows else self.weight.dtype

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.packed.numel() * self.packed.element_size()
