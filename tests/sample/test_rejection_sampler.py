"""The rejection sampler reproduces the target distribution (Leviathan et al.): on a vocabulary
of 6 tokens, the empirical distribution of the token emitted at each position converges to the
target's, for one-hot proposals (n-gram: the runner's form, tokens drawn by the real Sampler
and kept while they equal the proposal) and for full proposal distributions (a draft model's).

Each check is a chi-square goodness-of-fit test at significance 1e-6 over tens of thousands of
samples: the probability that a correct sampler fails one is 1e-6 per test and position. A
sampler that emitted the proposal's distribution, or skipped the recovery's normalisation,
fails by hundreds of standard deviations at these sample sizes (test_wrong_rule_is_caught).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from octavo.sample.metadata import SamplingMetadata
from octavo.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    num_accepted_one_hot,
    rejection_sample,
)
from octavo.sample.sampler import Sampler

VOCAB = 6
K = 3
NUM_SAMPLES = 60_000
ALPHA = 1e-6


def _targets(seed: int) -> torch.Tensor:
    """(K + 1, VOCAB) target distributions, one per verified position: token `pos` has about
    0.6 of position pos's mass, every token at least 0.02."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(K + 1, VOCAB, generator=generator) + 0.1
    probs[range(K + 1), range(K + 1)] += 2.0
    return probs / probs.sum(dim=1, keepdim=True)


def _assert_distributed_as(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts.sum() > 500, "too few samples at this position for the test to mean much"
    expected = probs.double() / probs.double().sum() * counts.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > ALPHA, (counts, expected)


def _assert_positions_follow(output: torch.Tensor, targets: torch.Tensor) -> None:
    """Every emitted token, at each position, follows that position's target (the targets do
    not depend on the tokens before them, so the law of a position's token is its target)."""
    for pos in range(K + 1):
        emitted = output[:, pos]
        _assert_distributed_as(emitted[emitted != PLACEHOLDER_TOKEN_ID], targets[pos])


def test_one_hot_proposals_through_the_sampler() -> None:
    """The runner's form: every position drawn by the Sampler (temperature 1), then the
    proposals kept while they equal the drawn tokens, and the first differing token emitted."""
    targets = _targets(0)
    # Each proposal is the likeliest token: accepted about 60% of the time.
    drafts = [0, 1, 2]
    torch.manual_seed(1)
    logits = targets.log().repeat(NUM_SAMPLES, 1)  # (NUM_SAMPLES * (K + 1), VOCAB)
    metadata = SamplingMetadata(
        temperature=torch.ones(logits.shape[0]),
        top_k=None,
        top_p=None,
        min_p=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        all_random=True,
    )
    drawn = Sampler()(logits, metadata).sampled_token_ids.view(NUM_SAMPLES, K + 1).tolist()
    output = torch.full((NUM_SAMPLES, K + 1), PLACEHOLDER_TOKEN_ID)
    for i, tokens in enumerate(drawn):
        num_emitted = num_accepted_one_hot(tokens, drafts) + 1
        output[i, :num_emitted] = torch.tensor(tokens[:num_emitted])
    _assert_positions_follow(output, targets)
    # Acceptance at the first position is the target's probability of the proposal.
    accepted_first = (output[:, 1] != PLACEHOLDER_TOKEN_ID).double().mean()
    assert abs(accepted_first - targets[0, drafts[0]]) < 5 * (0.25 / NUM_SAMPLES) ** 0.5


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_sample_follows_the_target(one_hot: bool) -> None:
    targets = _targets(2)
    generator = torch.Generator().manual_seed(3)
    if one_hot:
        draft_probs = None
        draft_ids = torch.tensor([[0, 1, 2]]).repeat(NUM_SAMPLES, 1)
    else:
        q = torch.rand(K, VOCAB, generator=generator) ** 3 + 0.01  # far from the targets
        q = q / q.sum(dim=1, keepdim=True)
        draft_probs = q.expand(NUM_SAMPLES, K, VOCAB)
        draft_ids = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=generator).view(
            NUM_SAMPLES, K
        )
    output = rejection_sample(
        targets.expand(NUM_SAMPLES, K + 1, VOCAB), draft_ids, draft_probs, generator
    )
    _assert_positions_follow(output, targets)
    # Accepted proposals come first, then one emitted token, then padding only.
    emitted = output != PLACEHOLDER_TOKEN_ID
    assert emitted[:, 0].all()
    assert (emitted[:, 1:] <= emitted[:, :-1]).all()


def test_wrong_rule_is_caught() -> None:
    """The test has power: emitting the proposal's distribution instead fails it."""
    targets = _targets(2)
    generator = torch.Generator().manual_seed(4)
    q = torch.rand(VOCAB, generator=generator) ** 3 + 0.01
    q = q / q.sum()
    wrong = torch.multinomial(q, NUM_SAMPLES, replacement=True, generator=generator)
    with pytest.raises(AssertionError):
        _assert_distributed_as(wrong, targets[0])


def test_num_accepted_one_hot() -> None:
    assert num_accepted_one_hot([5, 6, 7], [5, 6]) == 2
    assert num_accepted_one_hot([5, 9, 7], [5, 6]) == 1
    assert num_accepted_one_hot([4, 6, 7], [5, 6]) == 0
    assert num_accepted_one_hot([4], []) == 0
