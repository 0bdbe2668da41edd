"""Each sampling op against a plain reference written here: full sorts for the filters, Python
loops over small vocabularies for the penalties. Synthetic tensors, seeded, exact comparisons."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from octavo.sample.ops import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
    gather_logprobs,
    get_token_counts,
    pad_token_ids,
)

NEG_INF = float("-inf")
CPU = torch.device("cpu")


def random_logits(num_reqs: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_reqs, vocab_size, generator=generator) * 3.0


def kept(logits: torch.Tensor) -> torch.Tensor:
    return logits != NEG_INF


# --- references -----------------------------------------------------------------------------


def reference_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Full descending sort per row; keep everything >= the k-th value (0 or >= vocab is off)."""
    out = logits.clone()
    vocab_size = logits.shape[1]
    for row, k in enumerate(top_k):
        if 0 < k < vocab_size:
            kth = torch.sort(logits[row], descending=True).values[k - 1]
            out[row][logits[row] < kth] = NEG_INF
    return out


def reference_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Walk each row's tokens from the most likely, keeping them until the kept mass reaches p."""
    out = logits.clone()
    for row, p in enumerate(top_p):
        if p >= 1.0:
            continue
        probs = logits[row].softmax(dim=0)
        order = torch.sort(probs, descending=True).indices.tolist()
        mass = 0.0
        for token_id in order:
            if mass >= p:
                out[row, token_id] = NEG_INF
            mass += probs[token_id].item()
    return out


def reference_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    out = logits.clone()
    for row, p in enumerate(min_p):
        probs = logits[row].softmax(dim=0)
        out[row][probs < p * probs.max()] = NEG_INF
    return out


# --- top-k / top-p / min-p / temperature ----------------------------------------------------


def test_top_k_partial_selection_equals_full_sort() -> None:
    logits = random_logits(7, 50, seed=0)
    top_k = [0, 1, 3, 10, 49, 50, 100]
    out = logits.clone()
    apply_top_k_top_p(out, torch.tensor(top_k), None)
    assert torch.equal(out, reference_top_k(logits, top_k))
    assert kept(out).sum(dim=1).tolist() == [50, 1, 3, 10, 49, 50, 50]


def test_top_k_sorted_path_equals_partial_path() -> None:
    """With top_p present but 1.0 everywhere, the full-sort path must give the top-k answer."""
    logits = random_logits(5, 64, seed=1)
    top_k = torch.tensor([0, 2, 7, 63, 5])
    partial = logits.clone()
    apply_top_k_top_p(partial, top_k, None)
    sorted_path = logits.clone()
    apply_top_k_top_p(sorted_path, top_k, torch.ones(5))
    assert torch.equal(partial, sorted_path)


def test_top_k_keeps_ties_on_both_paths() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    for top_p in (None, torch.ones(1)):
        out = logits.clone()
        apply_top_k_top_p(out, torch.tensor([2]), top_p)
        assert kept(out).tolist() == [[False, True, True, True, False]]


def test_top_p_on_a_known_distribution() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])
    top_p = [0.45, 0.6, 0.75, 0.9, 1.0]
    logits = probs.log().repeat(len(top_p), 1)
    apply_top_k_top_p(logits, None, torch.tensor(top_p))
    assert kept(logits).tolist() == [
        [False, True, False, False, False],
        [False, True, False, True, False],
        [False, True, False, True, True],
        [False, True, True, True, True],
        [True, True, True, True, True],
    ]
    # Kept logits are untouched (not renormalised here).
    assert torch.equal(logits[4], probs.log())


def test_top_p_equals_reference_on_random_logits() -> None:
    logits = random_logits(8, 200, seed=2)
    top_p = [1.0, 0.9, 0.5, 0.1, 0.99, 0.3, 0.75, 0.01]
    out = logits.clone()
    apply_top_k_top_p(out, None, torch.tensor(top_p))
    assert torch.equal(out, reference_top_p(logits, top_p))


def test_top_k_then_top_p_equals_reference() -> None:
    logits = random_logits(6, 100, seed=3)
    top_k = [0, 5, 20, 1, 50, 0]
    top_p = [0.8, 0.8, 0.5, 0.3, 1.0, 1.0]
    out = logits.clone()
    apply_top_k_top_p(out, torch.tensor(top_k), torch.tensor(top_p))
    expected = reference_top_p(reference_top_k(logits, top_k), top_p)
    assert torch.equal(out, expected)


def test_top_p_always_keeps_the_most_likely_token() -> None:
    """The last row is flat: the stable sort makes the kept token the lowest id, like argmax."""
    logits = torch.cat([random_logits(3, 30, seed=4), torch.zeros(1, 30)])
    out = logits.clone()
    apply_top_k_top_p(out, None, torch.full((4,), 1e-6))
    assert kept(out).sum(dim=1).tolist() == [1, 1, 1, 1]
    assert torch.equal(kept(out).int().argmax(dim=1), logits.argmax(dim=1))


def test_min_p_equals_reference() -> None:
    logits = random_logits(5, 300, seed=5)
    min_p = [0.0, 0.01, 0.1, 0.5, 1.0]
    out = logits.clone()
    apply_min_p(out, torch.tensor(min_p))
    assert torch.equal(out, reference_min_p(logits, min_p))
    assert kept(out)[0].all()
    assert kept(out)[4].sum().item() == 1


def test_temperature_divides_random_rows_and_spares_greedy_rows() -> None:
    logits = random_logits(3, 10, seed=6)
    out = logits.clone()
    apply_temperature(out, torch.tensor([0.5, 0.0, 2.0]))
    assert torch.equal(out[0], logits[0] / 0.5)
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2], logits[2] / 2.0)


# --- penalties, bias, min_tokens ------------------------------------------------------------


def test_token_counts_match_counter() -> None:
    rows = [[3, 1, 3, 3], [], [0, 4, 4]]
    padded = pad_token_ids(rows, pad_id=5, device=CPU)
    assert padded.tolist() == [[3, 1, 3, 3], [5, 5, 5, 5], [0, 4, 4, 5]]
    counts = get_token_counts(padded, vocab_size=5)
    for row, tokens in enumerate(rows):
        assert counts[row].tolist() == [Counter(tokens)[t] for t in range(5)]


def test_penalties_equal_python_loop() -> None:
    vocab_size = 8
    logits = random_logits(4, vocab_size, seed=7)
    prompts = [[1, 2, 2], [7], [], [0, 5, 6, 3]]
    outputs = [[2, 2, 4], [], [1, 1, 1, 6], [3]]
    presence = [0.5, 1.0, -0.3, 0.0]
    frequency = [0.25, 0.0, 0.7, -1.5]
    repetition = [1.3, 2.0, 0.8, 1.0]

    out = logits.clone()
    apply_penalties(
        out,
        pad_token_ids(prompts, vocab_size, CPU),
        pad_token_ids(outputs, vocab_size, CPU),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )

    expected = logits.clone()
    for row in range(4):
        for token_id in range(vocab_size):
            # 0-d float32 tensors, so the reference rounds exactly as the batched op does.
            value = logits[row, token_id]
            count = outputs[row].count(token_id)
            rep = torch.tensor(repetition[row])
            if token_id in prompts[row] or count > 0:
                value = value / rep if value > 0 else value * rep
            value = value - torch.tensor(frequency[row]) * count
            value = value - torch.tensor(presence[row]) * (count > 0)
            expected[row, token_id] = value
    assert torch.equal(out, expected)
    # Rows and tokens with nothing to penalise are untouched.
    assert torch.equal(out[1, :7], logits[1, :7])


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = random_logits(3, 6, seed=8)
    out = logits.clone()
    apply_logit_bias(out, {0: {5: 2.5, 1: -100.0}, 2: {0: 0.75}})
    expected = logits.clone()
    expected[0, 5] += 2.5
    expected[0, 1] += -100.0
    expected[2, 0] += 0.75
    assert torch.equal(out, expected)


def test_logit_bias_out_of_vocab_raises() -> None:
    with pytest.raises(ValueError, match="logit_bias token id 6"):
        apply_logit_bias(torch.zeros(1, 6), {0: {6: 1.0}})


def test_min_tokens_masks_stop_ids_and_skips_out_of_vocab_ids() -> None:
    logits = random_logits(3, 6, seed=9)
    out = logits.clone()
    apply_min_tokens(out, {1: {0, 4, 99}, 2: set()})
    expected = logits.clone()
    expected[1, 0] = NEG_INF
    expected[1, 4] = NEG_INF
    assert torch.equal(out, expected)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_values_order_and_rank() -> None:
    logits = random_logits(4, 40, seed=10)
    logprobs = compute_logprobs(logits)
    sampled = torch.tensor([7, 0, 39, 12])
    result = gather_logprobs(logprobs, 3, sampled)

    assert torch.equal(logprobs, torch.log_softmax(logits, dim=1))
    assert result.token_ids.shape == (4, 4)
    assert result.token_ids[:, 0].tolist() == sampled.tolist()
    for row in range(4):
        order = sorted(range(40), key=lambda t: -logits[row, t].item())
        assert result.token_ids[row, 1:].tolist() == order[:3]
        assert result.sampled_ranks[row].item() == order.index(sampled[row].item()) + 1
        for col in range(4):
            token_id = result.token_ids[row, col].item()
            assert result.logprobs[row, col].item() == logprobs[row, token_id].item()


def test_logprobs_zero_k_and_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    result = gather_logprobs(compute_logprobs(logits), 0, torch.tensor([2]))
    assert result.token_ids.tolist() == [[2]]
    assert result.sampled_ranks.tolist() == [1]
    assert math.isclose(
        result.logprobs.item(), math.log(math.e**3 / (2 * math.e**3 + math.e + 1)), rel_tol=1e-6
    )
    with pytest.raises(ValueError, match="max_num_logprobs"):
        gather_logprobs(compute_logprobs(logits), 5, torch.tensor([2]))


def test_invert_cdf_never_picks_a_token_without_mass() -> None:
    """Regression guard for the rounding edge of inverse-CDF sampling: u * total rounding up to
    the total must not run past the last token with mass (here followed by zero-mass ones)."""
    from octavo.sample.ops.topk_topp import invert_cdf

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    cdf = probs.cumsum(dim=1)
    for u, expected in [(0.0, 1), (0.29, 1), (0.31, 3), (0.9999999, 3), (1.0, 3)]:
        assert invert_cdf(cdf, torch.tensor([[u]])).tolist() == [expected]
