"""PackedWeight: a float weight with a copy packed for the CPU's packed-panel matmul kernel.

BLAS GEMMs run far below memory bandwidth at decode sizes; the packed kernel streams each
panel contiguously (model/cpu/packing.py has the layout). Up to `max_rows` rows (measured when
the model is loaded, model/cpu/calibration.py) the kernel takes the matmul, above it torch's
GEMM on the float weight, which is kept for that. The packed copy is bfloat16 where every value
of the weight is an exact bf16 number, so its results equal float32 compute's.

On a CPU with bfloat16 dot products (AMX tiles, or AVX512-BF16 as on AMD's Zen 4) a bfloat16
weight may also have a copy in tile order (`tiles`, packing.tile_weight), which takes the rows
above the panels' limit up to `tiles_max_rows` (both measured: the panels against the tiles,
the tiles against the GEMM): decode batches of a few to 128 rows, where torch's GEMM reads the
weight well below the memory's bandwidth and the panels' float32 FMAs do half the products an
instruction. Its x is rounded to bfloat16 as the GEMM's is.
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
        self.tiles: Tensor | None = None  # packing.tile_weight's layout, or None
        self.tiles_max_rows = 0

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.shape[0]
        if rows <= self.max_rows:
            out = ops.packed_linear(x, self.packed, self.weight.shape[0])
        elif rows <= self.tiles_max_rows:
            out = self.tiles_matmul(x)
        else:
            return super().matmul(x, bias)
        if bias is not None:
            out += bias
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def panels_matmul(self, x: Tensor) -> Tensor:
        """x @ W^T on the packed panels (float32 FMAs; float32 x)."""
        return ops.packed_linear(x, self.packed, self.weight.shape[0])

    def tiles_matmul(self, x: Tensor) -> Tensor:
        """x @ W^T on the tile-order copy (float32; needs `tiles`)."""
        return ops.tiles_linear(x, self.tiles, self.weight.shape[0])

    def gemm_matmul(self, x: Tensor) -> Tensor:
        """x @ W^T by torch's GEMM, as for the rows above every kernel's limit."""
        return super().matmul(x, None)

    def gemm_input_dtype(self, rows: int) -> torch.dtype | None:
        # The tiles round x as the GEMM does but give float32 sums, not the GEMM's dtype.
        return None if rows <= max(self.max_rows, self.tiles_max_rows) else self.weight.dtype

    @property
    def nbytes(self) -> int:
        tiles = 0 if self.tiles is None else self.tiles.numel() * self.tiles.element_size()
        return super().nbytes + self.packed.numel() * self.packed.element_size() + tiles
