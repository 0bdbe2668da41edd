"""Linear layers: the matmul every projection goes through, and PackedLinear.

`linear()` sends a decode-sized batch (a few rows) on a CPU to the small-M kernel, which reads
each weight once for all rows; BLAS GEMMs run far below memory bandwidth there. Larger batches go
to torch's GEMM. A weight whose float32 values are all exact bfloat16 numbers (a checkpoint
stored in bf16, loaded for fp32 compute) also gets a bf16 copy, `compact_weight`, that the
kernel reads instead: the same numbers in half the bytes, so the result does not change.

PackedLinear: q/k/v and gate/up are separate tensors in every checkpoint; one wider Linear
replaces three (or two) kernel launches and reads of the input per layer. It owns the mapping
between the packed weight's rows and the checkpoint shards. This module must not know checkpoint
file formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octavo.model import kernels


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, compact_weight: Tensor | None = None
) -> Tensor:
    """x: (num_tokens, in) -> (num_tokens, out) in x's dtype."""
    small = compact_weight if compact_weight is not None else weight
    if kernels.use_small_m_linear(x, small):
        out = kernels.small_m_linear(x, small)
        if bias is not None:
            out += bias
        return out.to(x.dtype)
    return F.linear(x, weight, bias)


def exact_bfloat16(weight: Tensor) -> Tensor | None:
    """A bfloat16 copy of a float32 weight if every value survives the round trip, else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    compact = weight.detach().to(torch.bfloat16)
    return compact if torch.equal(compact.float(), weight) else None


def attach_compact_weights(model: nn.Module) -> int:
    """Give every Linear (and a tied embedding) whose weight is exactly bf16-representable its
    bf16 copy. Call once after loading; returns how many weights got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) or hasattr(module, "compact_weight"):
            module.compact_weight = exact_bfloat16(module.weight)
            count += module.compact_weight is not None
    return count


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear()`."""

    compact_weight: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.compact_weight)


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
