"""Logits processors that can change the argmax: logit bias, min_tokens masking and the
repetition / frequency / presence penalties.

Owns the batched tensor form of these per-request rules. Every function edits `logits`
(num_reqs, vocab) in place and returns nothing. Must not loop in Python over the vocabulary or
over a row's tokens to build counts: counts come from one scatter_add over a padded tensor. The
only Python loops are over the (few) entries a user wrote: logit_bias items and stop ids.
Knows nothing of requests: a row index is the only link to one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device_tensor(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """A small host list as a tensor on `device`, without a host-device sync.

    A plain torch.tensor(..., device="cuda") copies from pageable memory and waits for the copy;
    staging through pinned memory lets the copy run asynchronously behind the queued kernels.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """Rows of unequal length as one (num_rows, max_len) int64 tensor padded with `pad_id`.

    `pad_id` is the vocab size, so padding lands in a spare count column that is dropped.
    """
    max_len = max((len(row) for row in token_ids), default=0)
    flat = [tok for row in token_ids for tok in row + [pad_id] * (max_len - len(row))]
    # (num_rows, max_len)
    return to_device_tensor(flat, torch.int64, device).view(len(token_ids), max_len)


def get_token_counts(token_ids: Tensor, vocab_size: int) -> Tensor:
    """Occurrences of each vocabulary id per row: (num_rows, vocab_size) int64.

    `token_ids` is (num_rows, max_len) int64 padded with `vocab_size`; the padding is counted in
    one extra column that is cut off, so no mask over the padding is needed.
    """
    num_rows = token_ids.shape[0]
    # (num_rows, vocab_size + 1)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    """Add each row's {token_id: bias} to its logits. Raises ValueError for an id out of vocab."""
    if not logit_bias:
        return
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in logit_bias.items():
        rows.extend([row] * len(bias))
        cols.extend(bias.keys())
        values.extend(bias.values())
    if not cols:
        return
    bad = max(cols)
    if bad >= vocab_size:
        raise ValueError(f"logit_bias token id {bad} is out of vocabulary (size {vocab_size}).")
    index = (
        to_device_tensor(rows, torch.int64, logits.device),
        to_device_tensor(cols, torch.int64, logits.device),
    )
    # Each (row, token) appears once (dict keys), so accumulate only makes this an add.
    logits.index_put_(index, to_device_tensor(values, logits.dtype, logits.device), accumulate=True)


def apply_min_tokens(logits: Tensor, min_tokens_stop_ids: dict[int, set[int]]) -> None:
    """Forbid the stop ids of rows still below min_tokens by setting their logits to -inf
    (ids outside the vocabulary are skipped: the model can never produce them anyway; a user
    may name such an id in stop_token_ids)."""
    apply_banned_token_ids(logits, min_tokens_stop_ids)


def apply_banned_token_ids(logits: Tensor, banned: dict[int, set[int] | frozenset[int]]) -> None:
    """Each row's banned ids get -inf (ids beyond the vocabulary are skipped)."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in banned.items():
        for token_id in token_ids:
            if token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if not cols:
        return
    index = (
        to_device_tensor(rows, torch.int64, logits.device),
        to_device_tensor(cols, torch.int64, logits.device),
    )
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Tensor | None,
    output_token_ids: Tensor,
    presence_penalties: Tensor | None,
    frequency_penalties: Tensor | None,
    repetition_penalties: Tensor | None,
) -> None:
    """vLLM / OpenAI penalties, in this order, on (num_reqs, vocab) logits in place.

    1) repetition (HF/CTRL): a token seen in the prompt or the output has its logit divided by
       the penalty when positive and multiplied by it otherwise, so a penalty > 1 always makes
       the token less likely whatever the logit's sign.
    2) frequency: subtract penalty * (times the token appears in the output).
    3) presence: subtract penalty once if the token appears in the output at all.
    Token tensors are (num_reqs, len) int64 padded with vocab_size; a None penalty is off.
    """
    vocab_size = logits.shape[1]
    # (num_reqs, vocab)
    output_counts = get_token_counts(output_token_ids, vocab_size)
    output_mask = output_counts > 0
    if repetition_penalties is not None:
        seen = output_mask
        if prompt_token_ids is not None:
            seen = seen | (get_token_counts(prompt_token_ids, vocab_size) > 0)
        # (num_reqs, vocab): the row's penalty where seen, 1 elsewhere (a no-op either way).
        penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
        # torch.where instead of boolean indexing: indexing with a mask needs its nonzero count
        # on the host, a device sync.
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    if frequency_penalties is not None:
        logits -= frequency_penalties.unsqueeze(1) * output_counts
    if presence_penalties is not None:
        logits -= presence_penalties.unsqueeze(1) * output_mask
