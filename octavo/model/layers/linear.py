"""Linear layers: Linear, whose matmul is its weight format's, and PackedLinear.

A Linear keeps the checkpoint's weight as a parameter (that is what loading fills) and, once
the model is loaded, a `weight_format` (model/formats/) chosen by the backend: the dense tensor
through torch's GEMM, a copy packed for the CPU kernel, or GGML blocks. A checkpoint tensor in a
block type (formats.ggml.QuantizedTensor) is kept as it came (`quantized`, or per shard in a
PackedLinear), never turned into floats here: the backend makes its format from it and the
float parameter is then released. Its forward is that format's matmul, so a layer never asks
which kernel runs.

PackedLinear: q/k/v and gate/up are separate tensors in every checkpoint; one wider Linear
replaces three (or two) kernel launches and reads of the input per layer. It owns the mapping
between the packed weight's rows and the checkpoint shards. This module must not know checkpoint
file formats.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model.formats import LinearWeight
from octavo.model.formats.ggml import QuantizedTensor


class _Unprepared(LinearWeight):
    """The format of a Linear whose model has not been through ModelBackend.prepare_model."""

    name = "unprepared"

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        raise RuntimeError(
            "this Linear has no weight format yet: load the model with model.loader.load_model "
            "or call ModelBackend.prepare_model(model) after loading its weights."
        )

    def dequantize(self) -> Tensor:
        raise RuntimeError("unprepared Linear")

    @property
    def nbytes(self) -> int:
        return 0


UNPREPARED = _Unprepared()


class Linear(nn.Linear):
    """nn.Linear whose forward is `weight_format.matmul`."""

    weight_format: LinearWeight = UNPREPARED
    # The checkpoint's weight when it came as GGML blocks (then `weight` is not filled).
    quantized: QuantizedTensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.weight_format.matmul(x, self.bias)

    def weight_parts(self) -> list[QuantizedTensor | Tensor] | None:
        """What the weight was loaded as, by output rows: None when it is all in `weight`
        (float), else the parts in row order, each blocks or float rows."""
        return None if self.quantized is None else [self.quantized]


class PackedLinear(Linear):
    """A Linear whose output rows are named shards stacked in order.

    weight rows:  [ shard 0 (size s0) | shard 1 (size s1) | ... ]
    output:       (..., s0 + s1 + ...), split back with `split_output`
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        self.quantized_shards: dict[str, QuantizedTensor] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, shard: str, param_name: str, loaded: Tensor | QuantizedTensor) -> None:
        """Copy a checkpoint tensor into rows of `weight` or `bias` (param_name); a weight in
        GGML blocks is kept as it is (`weight_parts`). Raises ValueError if the shard or param
        is unknown or the shape does not fit."""
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
        if isinstance(loaded, QuantizedTensor):
            if param_name != "weight":
                loaded = loaded.dequantize(param.dtype)
            else:
                self.quantized_shards[shard] = loaded
                return
        with torch.no_grad():
            target.copy_(loaded)

    def weight_parts(self) -> list[QuantizedTensor | Tensor] | None:
        if not self.quantized_shards:
            return None
        parts: list[QuantizedTensor | Tensor] = []
        for shard, start in self.shard_offsets.items():
            blocks = self.quantized_shards.get(shard)
            size = self.shard_sizes[shard]
            parts.append(self.weight.data[start : start + size] if blocks is None else blocks)
        return parts

    def split_output(self, output: Tensor) -> tuple[Tensor, ...]:
        """Split (..., total) into one view per shard, in shard order."""
        return output.split(list(self.shard_sizes.values()), dim=-1)
