"""allowed_token_ids and bad_words in the sampler, on synthetic logits: a forbidden token is
never sampled even where it is the argmax, and the masks come before the bias and penalties."""

from __future__ import annotations

import torch

from octavo.sample.ops.allowed import banned_by_bad_words
from octavo.sample.sampler import Sampler

from .test_sampler import make_metadata, random_logits


def test_only_allowed_tokens_are_sampled_greedy_or_random() -> None:
    vocab = 50
    logits = random_logits(4, vocab, seed=0)
    top = logits.argmax(dim=1).tolist()
    allowed = {i: [t for t in range(0, vocab, 7) if t != top[i]] for i in range(3)}
    expected_greedy = max(allowed[0], key=lambda t: logits[0, t].item())
    generators = {1: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    for _ in range(50):
        metadata = make_metadata([0.0, 1.0, 2.0, 0.0], generators=generators)
        metadata.allowed_token_ids = allowed
        # A bias toward a disallowed token cannot bring it back.
        metadata.logit_bias = {0: {top[0]: 100.0}}
        sampled = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
        assert sampled[0] == expected_greedy
        assert sampled[1] in allowed[1] and sampled[2] in allowed[2]
        assert sampled[3] == top[3]  # a row without the rule is untouched


def test_bad_words_forbid_a_words_last_token_after_its_prefix() -> None:
    words = [[7], [3, 4, 5], [9, 4]]
    assert banned_by_bad_words([], words) == {7}
    assert banned_by_bad_words([1, 3], words) == {7}
    assert banned_by_bad_words([1, 3, 4], words) == {7, 5}
    assert banned_by_bad_words([9], words) == {7, 4}
    assert banned_by_bad_words([3, 4, 9], words) == {7, 4}


def test_a_banned_argmax_gives_the_next_best_token() -> None:
    logits = random_logits(2, 30, seed=3)
    top = logits.argmax(dim=1).tolist()
    metadata = make_metadata([0.0, 0.0])
    metadata.bad_words_banned = {0: frozenset({top[0]})}
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
    second = logits[0].topk(2).indices[1].item()
    assert sampled == [second, top[1]]
