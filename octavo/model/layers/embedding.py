"""VocabEmbedding: token id -> embedding row lookup.

Not nn.Embedding because its random initialisation runs even on the meta device, where
`normal_` pulls in torch's compiler stack at start-up; every octavo weight comes from a
checkpoint, so the parameter is left uninitialised here. Owns the lookup; a tied model's
output projection multiplies by the same weight through `head_format`. A table that came as
GGML blocks (`quantized`) stays in them: rows are dequantized when they are looked up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octavo.model.formats import LinearWeight
from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.layers.linear import UNPREPARED


class VocabEmbedding(nn.Module):
    # The weight's format as the output projection of a tied model (see layers/linear.py),
    # given by the backend when the model is loaded.
    head_format: LinearWeight = UNPREPARED
    # The checkpoint's table when it came as GGML blocks (then `weight` is not filled).
    quantized: QuantizedTensor | None = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # (vocab, hidden)
        # The compute dtype, which looked-up rows come out in (the table may be in another;
        # set by the loader); None: the table's.
        self.output_dtype: torch.dtype | None = None

    def forward(self, input_ids: Tensor) -> Tensor:
        """(num_tokens,) int64 -> (num_tokens, hidden)."""
        if self.quantized is not None:
            return self.head_format.embedding(input_ids)
        rows = F.embedding(input_ids, self.weight)
        return rows if self.output_dtype in (None, rows.dtype) else rows.to(self.output_dtype)

    def weight_parts(self) -> list[QuantizedTensor | Tensor] | None:
        """As Linear.weight_parts."""
        return None if self.quantized is None else [self.quantized]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
