"""Linear layers: the matmul every projection goes through, and PackedLinear.

`linear()` sends a batch of up to a weight's `packed_max_rows` (measured on the machine when the
model is loaded) on a CPU to the packed-panel kernel, reading `packed_weight`, a copy of the
weight laid out once at load time (`attach_packed_weights`) in panels each thread streams
contiguously; BLAS GEMMs run far below memory bandwidth at decode sizes. The copy is bfloat16
where every value of the weight is an exact bf16 number (a checkpoint stored in bf16, loaded for
fp32 compute): the same numbers in half the bytes, so results do not change. Other devices, and
larger batches, use torch's GEMM on `weight`.

PackedLinear: q/k/v and gate/up are separate tensors in every checkpoint; one wider Linear
replaces three (or two) kernel launches and reads of the input per layer. It owns the mapping
between the packed weight's rows and the checkpoint shards. This module must not know checkpoint
file formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octavo.model import kernels, memory


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    packed_weight: Tensor | None = None,
    packed_max_rows: int | None = None,
) -> Tensor:
    """x: (num_tokens, in) -> (num_tokens, out) in x's dtype. `packed_max_rows`: the most rows
    the packed kernel takes for this weight (kernels.PACKED_MAX_ROWS if None)."""
    if kernels.use_packed_linear(x, packed_weight, packed_max_rows):
        out = kernels.packed_linear(x, packed_weight, weight.shape[0])
        if bias is not None:
            out += bias
        return out if out.dtype == x.dtype else out.to(x.dtype)
    return F.linear(x, weight, bias)


def attach_packed_weights(model: nn.Module) -> tuple[int, int, int]:
    """Give every Linear (and a tied embedding, which has a `packed_weight` slot) its packed
    copy, when the CPU kernels are available, and each Linear of the decoder layers the row
    limit up to which the copy beats torch's GEMM on this machine
    (kernels.calibrate_packed_max_rows). Call once after loading. Returns (weights packed, how
    many of them in bfloat16, bytes the copies take). The copies share one allocation in huge
    pages (memory.empty_many): a decode step streams all of them, and with 4 KiB pages the TLB
    misses cost several percent of the batch-1 matmuls' time (BENCHMARKS.md)."""
    modules = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) or hasattr(module, "packed_weight"):
            module.packed_weight = None
            # packed_layout decides by device and dtype (None where the kernel can't run).
            layout = kernels.packed_layout(module.weight) if kernels.available() else None
            if layout is not None:
                modules.append((name, module, layout))
    # All the copies' places first, then each packed into its own: no second copy of them all.
    slots = memory.empty_many([layout for _, _, layout in modules])
    for (name, module, _), slot in zip(modules, slots):
        packed = module.packed_weight = kernels.pack_linear_weight(module.weight, out=slot)
        # The output projection only ever multiplies sampled rows, never a prompt's.
        if isinstance(module, Linear) and name.rpartition(".")[2] != "lm_head":
            module.packed_max_rows = kernels.calibrate_packed_max_rows(module.weight, packed)
    num_bf16 = sum(slot.dtype == torch.bfloat16 for slot in slots)
    nbytes = sum(slot.numel() * slot.element_size() for slot in slots)
    return len(slots), num_bf16, nbytes


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear()`."""

    packed_weight: Tensor | None = None
    packed_max_rows: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.packed_max_rows)


class PackedLinear(Linear):
    """A Linear whose output rows are named shards stacked in order.

    weight rows:  [ shard 0 (size s0) | shard 1 (size s1) | ... ]
    output:       (..., s0 + s1 + ...), split back with `split_output`
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, shard: str, param_name: str, loaded: Tensor) -> None:
        """Copy a checkpoint tensor into rows of `weight` or `bias` (param_name). Raises
        ValueError if the shard or param is unknown or the shape does not fit."""
        if shard not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard!r} (have {list(self.shard_sizes)}).")
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"PackedLinear has no parameter {param_name!r}.")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        target = param.data[start : start + size]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard!r} of {param_name} expects shape {tuple(target.shape)}, "
                f"got {tuple(loaded.shape)}."
            )
        with torch.no_grad():
            target.copy_(loaded)

    def split_output(self, output: Tensor) -> tuple[Tensor, ...]:
        """Split (..., total) into one view per shard, in shard order."""
        return output.split(list(self.shard_sizes.values()), dim=-1)
