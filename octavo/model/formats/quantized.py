"""QuantizedWeight: a linear weight kept as GGML blocks (formats/ggml.py) and multiplied on them.

The blocks are all the weight there is: no float copy is held. Up to `max_rows` rows of x
(decode-sized batches, where the weight's bytes are the cost) the CPU kernel computes on the
blocks (model/cpu/csrc/quant_linear.cpp: x rounded to 8 bits per 32 values, integer dot
products), reading each byte once; above it (prompt chunks, where the arithmetic is the cost)
the weight is dequantized to the compute dtype for the call and multiplied by torch's GEMM.
Without the kernels (another device, or the kernels off) every call takes that second path
with the plain-torch dequantization, which is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.formats.base import LinearWeight
from octavo.model.formats.ggml import QuantizedTensor

# Rows up to which the block kernel takes a matmul where nothing was measured.
QUANT_MAX_ROWS = 16


class QuantizedWeight(LinearWeight):
    def __init__(
        self, tensor: QuantizedTensor, dtype: torch.dtype, kernels: bool, max_rows: int
    ) -> None:
        self.tensor = tensor
        self.dtype = dtype  # the compute dtype: what dequantized weights are made in
        self.kernels = kernels
        self.max_rows = max_rows if kernels else 0
        self.name = tensor.qtype.name

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= self.max_rows:
            from octavo.model.cpu import ops

            t = self.tensor
            out = ops.quant_linear(x, t.blocks, t.qtype, t.shape[0])
            if bias is not None:
                out += bias
            return out if out.dtype == x.dtype else out.to(x.dtype)
        return F.linear(x, self._dequantize(self.tensor.blocks, x.dtype), bias)

    def embedding(self, ids: Tensor) -> Tensor:
        return self._dequantize(self.tensor.blocks.index_select(0, ids), self.dtype)

    def dequantize(self) -> Tensor:
        return self._dequantize(self.tensor.blocks, self.dtype)

    def _dequantize(self, blocks: Tensor, dtype: torch.dtype) -> Tensor:
        t = self.tensor
        if self.kernels and dtype in (torch.float32, torch.bfloat16):
            from octavo.model.cpu import ops

            return ops.quant_dequantize(blocks, t.qtype, t.shape[1], dtype)
        return QuantizedTensor(blocks, t.qtype, (blocks.shape[0], t.shape[1])).dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor.shape
