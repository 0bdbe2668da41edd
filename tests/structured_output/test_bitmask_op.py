"""The sampler-side bitmask op against a plain per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.sample.ops.bitmask import allows_other_tokens, apply_token_bitmask


def reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            bit = 0 if word >= bitmask.shape[1] else (int(bitmask[i, word]) >> (token % 32)) & 1
            if not bit:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, num_words", [(64, 2), (70, 3), (100, 2)])
def test_masks_exactly_the_cleared_bits_of_the_chosen_rows(vocab, num_words) -> None:
    """(70, 3): padding bits past the vocabulary are ignored; (100, 2): tokens without a bit
    are disallowed."""
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, num_words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    expected = reference(logits, bitmask, [3, 1])
    apply_token_bitmask(logits, torch.from_numpy(bitmask), torch.tensor([3, 1]))
    assert torch.equal(logits, expected)
    # Rows 0 and 2 carry no mask and are untouched.
    assert torch.isfinite(logits[[0, 2]]).all()


def test_sign_bit_and_all_ones() -> None:
    logits = torch.zeros(1, 64)
    bitmask = torch.tensor([[-1, np.int32(-(2**31))]], dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [*range(32), 63]


def test_no_rows_is_a_no_op() -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0).long())
    assert torch.equal(logits, before)


def test_allows_other_tokens() -> None:
    row = np.zeros(2, dtype=np.int32)
    row[0] = 1 << 2  # token 2 only
    assert not allows_other_tokens(row, {2})
    assert allows_other_tokens(row, {3})
    row[1] = np.int32(-(2**31))  # and token 63
    assert allows_other_tokens(row, {2})
    assert not allows_other_tokens(row, {2, 63, 1000})
