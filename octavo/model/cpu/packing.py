"""The packed-panel layout packed_linear reads: x @ W^T's weight laid out once at load time.

Panel p holds output columns wp..wp+w-1 (w = build.panel_width(): two of the kernel's vectors)
for every input column, so a thread streams its panels as one contiguous run of memory (zero
rows pad the last panel). The copy is bfloat16 where every value of the weight is an exact bf16
number (a checkpoint stored in bf16, loaded for float32 compute): the same numbers in half the
bytes, so results do not change. Layout only; no kernels run here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.model.cpu import build


def _bf16_panel_order(width: int) -> list[int]:
    """bf16 panels interleave their halves (0, h, 1, h + 1, ...): each 32-bit word holds column
    i and column h + i, so one load widens to two float32 vectors with a shift and a mask."""
    half = width // 2
    return [j for i in range(half) for j in (i, half + i)]


def packed_layout(
    weight: Tensor, allow_bf16: bool = True
) -> tuple[tuple[int, int, int], torch.dtype] | None:
    """The (shape, dtype) `pack_linear_weight` gives this weight, or None where it gives none:
    (ceil(n / w), k, w) for an (n, k) weight, w = build.panel_width(); bfloat16 (half the
    bytes) when every value is exactly a bf16 number, which keeps the results of float32
    compute unchanged, unless `allow_bf16` is False; else float32. None for other dtypes or
    devices."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    n, k = weight.shape
    width = build.panel_width()
    exact = allow_bf16 and (
        weight.dtype == torch.bfloat16 or torch.equal(weight.to(torch.bfloat16).float(), weight)
    )
    return (-(-n // width), k, width), torch.bfloat16 if exact else torch.float32


def pack_linear_weight(
    weight: Tensor, allow_bf16: bool = True, out: Tensor | None = None
) -> Tensor | None:
    """The weight (n, k) of a CPU linear layer packed for `packed_linear`, laid out as
    `packed_layout` says. Written into `out` if given (a tensor of that layout), else into a new
    tensor; None where `packed_layout` is None."""
    if out is None:
        layout = packed_layout(weight, allow_bf16)
        if layout is None:
            return None
        out = torch.empty(layout[0], dtype=layout[1])
    weight = weight.detach()
    num_panels, k, width = out.shape
    padded = weight.new_zeros(num_panels * width, k, dtype=out.dtype)
    padded[: weight.shape[0]] = weight
    panels = padded.view(num_panels, width, k)
    if out.dtype == torch.bfloat16:
        panels = panels[:, _bf16_panel_order(width)]
    return out.copy_(panels.transpose(1, 2))


def unpack_linear_weight(packed: Tensor, n: int) -> Tensor:
    """The (n, k) weight a packed one holds, in the packed dtype (the inverse of packing)."""
    panels = packed.transpose(1, 2)
    if packed.dtype == torch.bfloat16:
        panels = panels[:, torch.argsort(torch.tensor(_bf16_panel_order(packed.shape[2])))]
    return panels.reshape(-1, packed.shape[1])[:n]


def tiled_shape(weight: Tensor) -> tuple[int, ...]:
    """The shape `tile_weight` gives an (n, k) weight: (ceil(n / 32), ceil(k / 32), 2, 16, 16,
    2)."""
    n, k = weight.shape
    return (-(-n // 32), -(-k // 32), 2, 16, 16, 2)


def tile_weight(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """A bfloat16 copy of the (n, k) weight in the order tiles_linear's kernels read it (written
    into `out`, of tiled_shape, if given): element [g][s][h][p][c][e] = W[32 g + 16 h + c][32 s
    + 2 p + e], zeros past n and k, so that a tile (16 columns of the output, 32 values of k
    as 16 pairs) is 1 KB of contiguous memory."""
    n, k = weight.shape
    groups, slices = -(-n // 32), -(-k // 32)
    padded = weight.detach().new_zeros(groups * 32, slices * 32, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    # [g][h][c][s][p][e] -> [g][s][h][p][c][e]
    tiled = padded.view(groups, 2, 16, slices, 16, 2).permute(0, 3, 1, 4, 2, 5)
    if out is None:
        return tiled.contiguous()
    return out.copy_(tiled)
