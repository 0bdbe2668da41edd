"""BlockPool, FreeBlockQueue and chained block hashing, without any request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from octavo.core.block_hash import ROOT_BLOCK_HASH, extend_block_hashes, hash_block_tokens
from octavo.core.block_pool import Block, BlockPool, FreeBlockQueue
from octavo.metrics.stats import KVBlockEvent


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def cache(pool: BlockPool, blocks: list[Block], first_token: int) -> list[int]:
    """Cache `blocks` as a chain of 4-token blocks starting at `first_token`; their keys."""
    token_ids = list(range(first_token, first_token + 4 * len(blocks)))
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, 4)
    tuples = [tuple(token_ids[i * 4 : i * 4 + 4]) for i in range(len(blocks))]
    pool.cache_full_blocks(blocks, hashes, tuples)
    return hashes


# --- hashing ----------------------------------------------------------------------------------


def test_hashes_chain_over_full_blocks_only() -> None:
    hashes: list[int] = []
    assert extend_block_hashes(hashes, list(range(11)), 4) == 2
    first = hash_block_tokens(None, (0, 1, 2, 3))
    assert first == hash((ROOT_BLOCK_HASH, (0, 1, 2, 3)))
    assert hashes == [first, hash_block_tokens(first, (4, 5, 6, 7))]
    # Growing the token list one token at a time gives the same chain as all at once.
    grown: list[int] = []
    tokens: list[int] = []
    for token in range(13):
        tokens.append(token)
        extend_block_hashes(grown, tokens, 4)
    assert grown[:2] == hashes and len(grown) == 3
    assert extend_block_hashes(grown, tokens, 4) == 0


def test_hash_depends_on_parent_and_extra_keys() -> None:
    a: list[int] = []
    b: list[int] = []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    extend_block_hashes(b, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    # Same tokens in the second block, different prefix: different key.
    assert a[0] != b[0] and a[1] != b[1]
    with_extra = hash_block_tokens(None, (1, 2, 3, 4), (7,))
    assert with_extra != a[0] and with_extra == hash_block_tokens(None, (1, 2, 3, 4), (7,))


def test_hash_is_the_same_in_another_process() -> None:
    code = (
        "from octavo.core.block_hash import extend_block_hashes as e; h = []; "
        "e(h, list(range(8)), 4); print(h)"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here: list[int] = []
    extend_block_hashes(here, list(range(8)), 4)
    assert result.stdout.strip() == str(here)


# --- free queue -------------------------------------------------------------------------------


def test_free_queue_order_and_middle_removal() -> None:
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 1, 3, 4, 0]
    assert queue.num_free_blocks == 5
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    for expected in (2, 1, 3, 4, 0):
        assert queue.popleft().block_id == expected
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[3])


# --- pool -------------------------------------------------------------------------------------


def test_get_new_blocks_takes_the_front() -> None:
    pool = BlockPool(10, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 7
    assert pool.get_usage() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="num_blocks=8"):
        pool.get_new_blocks(8)
    pool.free_blocks(reversed(blocks))
    # Unhashed blocks go to the front: reused before anything else.
    assert queue_ids(pool) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    pool.check_integrity()


def test_cached_blocks_stay_reusable_until_taken_in_lru_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    first = pool.get_new_blocks(2)  # 0, 1
    second = pool.get_new_blocks(2)  # 2, 3
    first_hashes = cache(pool, first, 0)
    second_hashes = cache(pool, second, 100)
    assert [b.block_hash for b in first] == first_hashes
    pool.free_blocks(reversed(first))
    pool.free_blocks(reversed(second))
    # Hashed blocks go to the back, a request's tail before its head.
    assert queue_ids(pool) == [4, 5, 1, 0, 3, 2]
    assert pool.get_cached_block(first_hashes[0], (0, 1, 2, 3)) is first[0]
    pool.check_integrity()

    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [4, 5, 1]
    # Block 1 was taken, so its key is gone; block 0 is still a hit.
    assert pool.get_cached_block(first_hashes[1], (4, 5, 6, 7)) is None
    assert taken[2].block_hash is None and taken[2].token_ids is None
    assert pool.get_cached_block(first_hashes[0], (0, 1, 2, 3)) is first[0]
    pool.free_blocks(reversed(taken))
    # Unhashed blocks, each put in front, end up in their original order.
    assert queue_ids(pool) == [4, 5, 1, 0, 3, 2]
    assert set(pool.cached_block_map) == {first_hashes[0], *second_hashes}
    pool.check_integrity()


def test_hit_requires_equal_tokens() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    hashes = cache(pool, blocks, 0)
    # A colliding key with other tokens is not a hit.
    assert pool.get_cached_block(hashes[0], (0, 1, 2, 4)) is None
    assert pool.get_cached_block(hashes[0], (0, 1, 2, 3)) is blocks[0]
    pool.free_blocks(blocks)
    pool.check_integrity()


def test_touch_pulls_a_free_block_out_of_the_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = cache(pool, blocks, 0)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [2, 3, 1, 0]
    hit = pool.get_cached_block(hashes[1], (4, 5, 6, 7))
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [2, 3, 0]
    pool.touch([hit])  # a second holder of a block in use
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [2, 3, 0]
    pool.free_blocks([hit])
    assert queue_ids(pool) == [2, 3, 0, 1]
    with pytest.raises(ValueError, match="ref_cnt=0"):
        pool.free_blocks([hit])
    pool.check_integrity()


def test_second_block_with_a_cached_key_stays_unhashed() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    hashes = cache(pool, a, 0)
    assert cache(pool, b, 0) == hashes
    assert b[0].block_hash is None and pool.cached_block_map == {hashes[0]: a[0]}
    pool.free_blocks(b)
    pool.free_blocks(a)
    assert queue_ids(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_uncache_and_caching_disabled() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, 0)
    pool.uncache_blocks(blocks[1:])
    assert [b.block_hash is None for b in blocks] == [False, True]
    assert len(pool.cached_block_map) == 1
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [1, 2, 0]
    pool.check_integrity()

    off = BlockPool(3, enable_caching=False)
    blocks = off.get_new_blocks(1)
    cache(off, blocks, 0)
    assert blocks[0].block_hash is None and off.cached_block_map == {}
    off.free_blocks(blocks)
    off.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, 0)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_map) == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_map == {}
    assert all(b.block_hash is None and b.token_ids is None for b in pool.blocks)
    pool.check_integrity()


def test_check_integrity_catches_a_leak() -> None:
    pool = BlockPool(3, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.check_integrity()
    block.ref_cnt = 0  # claims free, but is not in the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
    block.ref_cnt = 1
    pool.free_blocks([block])
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 3


def test_residency_sampling_reports_a_share_of_the_blocks_lives() -> None:
    """With half the allocations sampled, every other block taken starts a sampled life; a
    prefix hit on one is an access, and taking it again for other data ends its life. Without
    sampling, nothing is reported."""
    pool = BlockPool(4, enable_caching=True, residency_sample=0.5)
    blocks = pool.get_new_blocks(4)  # the 2nd and 4th allocations are sampled
    hashes = cache(pool, blocks, 0)
    assert pool.take_residency_events() == [
        (KVBlockEvent.ALLOCATED, 1),
        (KVBlockEvent.ALLOCATED, 3),
    ]
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 2, 1, 0]
    pool.touch([pool.get_cached_block(hashes[1], (4, 5, 6, 7))])
    pool.touch([pool.get_cached_block(hashes[0], (0, 1, 2, 3))])  # not sampled
    assert pool.take_residency_events() == [(KVBlockEvent.ACCESSED, 1)]
    taken = pool.get_new_blocks(2)  # 3 (sampled: its life ends) and 2, newly sampled
    assert [b.block_id for b in taken] == [3, 2]
    assert pool.take_residency_events() == [
        (KVBlockEvent.EVICTED, 3),
        (KVBlockEvent.ALLOCATED, 2),
    ]
    assert pool.take_residency_events() == []
    pool.free_blocks([*taken, blocks[1], blocks[0]])
    pool.check_integrity()

    unsampled = BlockPool(4, enable_caching=True)
    unsampled.free_blocks(unsampled.get_new_blocks(4))
    unsampled.get_new_blocks(4)
    assert unsampled.take_residency_events() == []
    with pytest.raises(ValueError, match="residency_sample"):
        BlockPool(4, enable_caching=True, residency_sample=1.5)
