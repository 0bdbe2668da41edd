"""PrefixRouter: a request follows its cached prefix unless the guard says that replica is too
loaded; otherwise the least loaded replica takes it, ties going round."""

from __future__ import annotations

import pytest

from octavo.core.block_hash import extend_block_hashes
from octavo.core.router import PrefixRouter


def keys(token_ids: list[int], block_size: int = 4) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size)
    return hashes


SHARED = list(range(100, 112))  # three blocks of four


def test_a_request_goes_where_its_longest_cached_prefix_is() -> None:
    router = PrefixRouter(3, capacity=100)
    assert router.route(keys(SHARED + [1, 2, 3, 4])) == 0
    assert router.route(keys([7] * 16)) == 1  # nothing cached: the least loaded
    # Three blocks cached on 0 win over 0's higher load.
    assert router.route(keys(SHARED + [5, 6, 7, 8])) == 0
    # Two blocks in common with what went to 1.
    assert router.route(keys([7] * 8 + [8] * 8)) == 1
    assert router.route(keys([9] * 16)) == 2
    assert router.load == [2, 2, 1]


def test_without_a_cached_prefix_the_least_loaded_takes_it_and_ties_go_round() -> None:
    router = PrefixRouter(2, capacity=100)
    first = [router.route(keys([i] * 8)) for i in range(4)]
    assert first == [0, 1, 0, 1]
    router.finished(1, 2)
    assert router.route(keys([50] * 8)) == 1
    # Shorter than a block: no key, load alone decides.
    assert router.route([]) == 1


def test_the_guard_sends_a_cached_prefix_elsewhere_once_its_replica_is_overloaded() -> None:
    router = PrefixRouter(2, capacity=100, balance_abs=2, balance_rel=1.5)
    prompt = keys(SHARED + [1, 2, 3, 4])
    placed = [router.route(prompt) for _ in range(4)]
    # 0 takes it while it holds at most 2 more than 1, then 1 does (and holds the prefix).
    assert placed == [0, 0, 0, 1]
    assert router.match(1, prompt) == len(prompt)
    # Both hold it now: the less loaded gets the next ones.
    assert router.route(prompt) == 1
    assert router.load == [3, 2]


def test_each_replica_remembers_at_most_capacity_keys_oldest_forgotten_first() -> None:
    router = PrefixRouter(2, capacity=3)
    old, new = keys([1] * 12), keys([2] * 12)
    router.assign(0, old)
    router.assign(0, new)
    assert router.match(0, new) == 3 and router.match(0, old) == 0
    # Its cache was reset: nothing is thought to be there.
    router.forget(0)
    assert router.match(0, new) == 0


def test_a_dead_replica_gets_nothing_and_none_left_is_an_error() -> None:
    router = PrefixRouter(2, capacity=100)
    prompt = keys(SHARED)
    assert router.route(prompt) == 0
    router.mark_dead(0)
    assert router.route(prompt) == 1
    router.mark_dead(1)
    with pytest.raises(ValueError, match="no engine replica"):
        router.route(prompt)
    with pytest.raises(ValueError, match="num_replicas"):
        PrefixRouter(0, capacity=1)
