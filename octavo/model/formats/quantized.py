"""QuantizedWeight: a linear weight kept as GGML blocks (formats/ggml.py) and multiplied on them.

The blocks are all the weight there is: no float copy is held. Up to `max_rows` rows of x
(decode-sized batches, where the weight's bytes are the cost) the CPU kernel computes on the
blocks (model/cpu/csrc/quant_linear.cpp: x rounded to 8 bits per 32 values, integer dot
products), reading each byte once; above it (prompt chunks, where the arithmetic is the cost)
the weight is dequantized to the compute dtype for the call and multiplied by torch's GEMM.
Between the two, where the CPU has AMX-BF16 and the GEMM is a bfloat16 one, the tile kernel
(quant_linear_tiles) takes rows up to `tiles_max_rows`: the same bf16 rounding of the weight,
dequantized a few rows at a time into cache instead of whole into memory, and AMX tile dot
products. Without the kernels (another device, or the kernels off) every call takes that second path
with the plain-torch dequantization, which is the reference the kernels are tested against.
Where the kernels have a repacked layout of the type (all but Q2_K and Q3_K, with AVX-512), the
blocks are held in it (`kernel_type`: the same bytes rearranged, which only the kernels read).
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
        self,
        tensor: QuantizedTensor,
        dtype: torch.dtype,
        kernels: bool,
        max_rows: int,
        kernel_type: int | None = None,
        gemm_dtype: torch.dtype | None = None,
    ) -> None:
        self.tensor = tensor  # its blocks in kernel_type's layout, when that is given
        self.dtype = dtype  # the compute dtype: what dequantized weights are made in
        self.kernels = kernels
        self.max_rows = max_rows if kernels else 0
        self.kernel_type = int(tensor.qtype) if kernel_type is None else kernel_type
        # The dtype a prompt-sized matmul dequantizes to and multiplies in (x converted).
        self.gemm_dtype = dtype if gemm_dtype is None else gemm_dtype
        if kernel_type is not None and not kernels:
            raise ValueError("a repacked layout needs the CPU kernels, which read it")
        self.name = tensor.qtype.name
        # Rows up to which (above max_rows) the AMX tile kernel takes a matmul; 0: none. Only
        # for a bfloat16 GEMM (its rounding is the one the tiles compute with).
        self.tiles_max_rows = 0

    @property
    def tiles(self) -> bool:
        """Whether the AMX tile kernel can take this weight's matmuls on this machine."""
        if not (self.kernels and self.gemm_dtype == torch.bfloat16):
            return False
        from octavo.model.cpu import ops

        return ops.amx_tiles_available()

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.shape[0]
        if rows > max(self.max_rows, self.tiles_max_rows):
            return self.gemm_matmul(x, bias)
        out = self.kernel_matmul(x) if rows <= self.max_rows else self.tiles_matmul(x)
        if bias is not None:
            out += bias
        return out

    def kernel_matmul(self, x: Tensor) -> Tensor:
        """x @ W^T by the block kernel (the CPU kernels must be loaded), in x's dtype."""
        from octavo.model.cpu import ops

        t = self.tensor
        out = ops.quant_linear(x, t.blocks, self.kernel_type, t.shape[0])
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def tiles_matmul(self, x: Tensor) -> Tensor:
        """x @ W^T by the AMX tile kernel (where `tiles`), in x's dtype: the float32 product of
        W dequantized to bfloat16 and x rounded to it, as gemm_matmul's bf16 GEMM multiplies."""
        from octavo.model.cpu import ops

        t = self.tensor
        out = ops.quant_linear_tiles(x, t.blocks, self.kernel_type, t.shape[0])
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def gemm_matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ W^T + bias with W dequantized for the call, by torch's GEMM in gemm_dtype."""
        if self.gemm_dtype == x.dtype:
            return F.linear(x, self._dequantize(self.tensor.blocks, x.dtype), bias)
        weight = self._dequantize(self.tensor.blocks, self.gemm_dtype)
        out = F.linear(x.to(self.gemm_dtype), weight).to(x.dtype)
        return out if bias is None else out + bias

    def embedding(self, ids: Tensor) -> Tensor:
        return self._dequantize(self.tensor.blocks.index_select(0, ids), self.dtype)

    def dequantize(self) -> Tensor:
        return self._dequantize(self.tensor.blocks, self.dtype)

    def _dequantize(self, blocks: Tensor, dtype: torch.dtype) -> Tensor:
        t = self.tensor
        if self.kernels:
            from octavo.model.cpu import ops

            kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
            out = ops.quant_dequantize(blocks, self.kernel_type, t.shape[1], kernel_dtype)
            return out if out.dtype == dtype else out.to(dtype)
        return QuantizedTensor(blocks, t.qtype, (blocks.shape[0], t.shape[1])).dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor.shape
