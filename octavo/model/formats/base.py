"""LinearWeight, the interface of a weight format, and DenseWeight, the float one."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.cpu import onednn


class LinearWeight(ABC):
    """One linear layer's (n, k) weight in some storage format."""

    # Short name for the start-up log ("dense", "packed-bf16", ...).
    name: str = ""

    @abstractmethod
    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x: (m, k) -> x @ W^T + bias, (m, n) in x's dtype. Reads, never writes, the weight."""

    @abstractmethod
    def dequantize(self) -> Tensor:
        """The (n, k) weight this format stands for, as a float tensor (its reference)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this format keeps in memory for the weight (every copy it holds)."""

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k): output and input features."""
        return tuple(self.dequantize().shape)  # type: ignore[return-value]

    def gemm_input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype x is rounded to when `rows` rows are multiplied by torch's GEMM on a float
        weight (its dtype), where this format does that; None where it does something else
        for that many rows (a kernel of its own, blocks)."""
        return None

    def embedding(self, ids: Tensor) -> Tensor:
        """Rows `ids` (num_tokens,) int64 of the weight, (num_tokens, k): the lookup of an
        embedding table held in this format."""
        return F.embedding(ids, self.dequantize())


class DenseWeight(LinearWeight):
    """The checkpoint's float tensor, multiplied by torch's GEMM (any device, any float dtype).
    A weight in another dtype than x's (bfloat16 weights under float32 compute) multiplies in
    its own: x is rounded to it, and the product comes back in x's dtype. Where the backend
    gave it `onednn_weight` (the same weight reordered once for oneDNN's linear,
    model/cpu/onednn.py), the GEMM multiplies that instead, with the same roundings."""

    name = "dense"

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight  # (n, k)
        self.onednn_weight: Tensor | None = None

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.dtype == self.weight.dtype:
            return self._gemm(x, bias)
        out = self._gemm(x.to(self.weight.dtype), None).to(x.dtype)
        return out if bias is None else out.add_(bias)

    def gemm_input_dtype(self, rows: int) -> torch.dtype | None:
        return self.weight.dtype

    def _gemm(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.onednn_weight is not None:
            return onednn.linear(x, self.onednn_weight, bias)
        return F.linear(x, self.weight, bias)

    def dequantize(self) -> Tensor:
        return self.weight

    @property
    def nbytes(self) -> int:
        copy = 0 if self.onednn_weight is None else onednn.nbytes(self.onednn_weight)
        return self.weight.numel() * self.weight.element_size() + copy

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]


class ConcatWeight(LinearWeight):
    """Several weights stacked by output rows, each in its own format: a packed projection
    whose checkpoint shards came in different formats (a Q4_K_M file's Q4_K q/k with a Q6_K v).
    Its matmul is each part's, concatenated."""

    def __init__(self, parts: list[LinearWeight]) -> None:
        self.parts = parts
        self.name = "+".join(part.name for part in parts)

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out = torch.cat([part.matmul(x, None) for part in self.parts], dim=-1)
        return out if bias is None else out + bias

    def dequantize(self) -> Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(part.shape[0] for part in self.parts), self.parts[0].shape[1])
