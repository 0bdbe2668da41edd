"""Token bitmask application: the structured-output constraint on a batch of logits.

Owns the unpacking of a packed allowed-token mask (int32 words, bit t % 32 of word t // 32 set
= token t allowed, the layout llguidance and xgrammar write) and the -inf fill. Runs before any
other logits processor, so bias, penalties, temperature, the filters and the logprobs all see
the constrained distribution. Knows nothing of grammars or requests: rows and bits only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """In place: `logits[rows[i], t] = -inf` for every token t that `bitmask[i]` does not allow.

    logits: (num_reqs, vocab); bitmask: (len(rows), num_words) int32 on the logits' device;
    rows: (len(rows),) int64. Other rows are untouched. Token ids the mask has no bit for
    (a model vocabulary wider than 32 * num_words) are disallowed; bits past the vocabulary
    (the mask's padding to a whole word) are ignored.
    """
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # (len(rows), num_words * 32); an arithmetic shift keeps the sign bit's word correct.
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def allows_other_tokens(bitmask_row: np.ndarray, token_ids: Iterable[int]) -> bool:
    """Whether one packed mask row (int32 words) allows some token outside `token_ids`."""
    words = bitmask_row.astype(np.uint32)
    for token_id in token_ids:
        if token_id // 32 < words.shape[0]:
            words[token_id // 32] &= ~np.uint32(1 << (token_id % 32))
    return bool(words.any())
