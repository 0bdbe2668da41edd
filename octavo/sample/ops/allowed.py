"""Token masks a request sets on itself: vLLM's allowed_token_ids and bad_words.

Owns which tokens these rules forbid at one step (bad words' ids are filled with -inf by
penalties.apply_banned_token_ids, the fill min_tokens uses too). Both run before the logit
bias and the penalties, so no later step can bring a forbidden token back. Must not know about
requests: a row index is the only link to one, and a row's output tokens so far arrive with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from octavo.sample.ops.penalties import to_device_tensor


def banned_by_bad_words(
    output_token_ids: Sequence[int], bad_words: Sequence[Sequence[int]]
) -> set[int]:
    """The tokens `bad_words` (token id sequences) forbid next, after `output_token_ids`: the
    last token of each sequence whose other tokens the output ends with (a one-token sequence
    is always forbidden)."""
    banned: set[int] = set()
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix) :]) == prefix:
            banned.add(word[-1])
    return banned


def apply_allowed_token_ids(logits: Tensor, allowed_token_ids: dict[int, Sequence[int]]) -> None:
    """Every token of a row outside its allowed ids gets -inf. Ids beyond the vocabulary are
    skipped (the input processor refuses them before a request runs)."""
    if not allowed_token_ids:
        return
    vocab_size = logits.shape[1]
    rows = list(allowed_token_ids)
    # (num_rows, vocab) True where the token is forbidden.
    forbidden = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=logits.device)
    index_rows: list[int] = []
    index_cols: list[int] = []
    for i, row in enumerate(rows):
        ids = [t for t in allowed_token_ids[row] if t < vocab_size]
        index_rows.extend([i] * len(ids))
        index_cols.extend(ids)
    if index_cols:
        forbidden[
            to_device_tensor(index_rows, torch.int64, logits.device),
            to_device_tensor(index_cols, torch.int64, logits.device),
        ] = False
    row_index = to_device_tensor(rows, torch.int64, logits.device)
    logits[row_index] = logits[row_index].masked_fill(forbidden, float("-inf"))
