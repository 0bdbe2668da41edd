"""KVCacheManager on its own: 10 blocks of 4 tokens, requests driven by hand."""

from __future__ import annotations

import pytest

from octavo.core.block_hash import extend_block_hashes
from octavo.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, sliding_window_blocks
from octavo.core.request import Request

from .utils import make_request

BLOCK_SIZE = 4


def request(request_id: str, prompt: list[int]) -> Request:
    return make_request(request_id, prompt, block_size=BLOCK_SIZE)


def admit(kv: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: hits, then the rest as one chunk."""
    blocks, num_hit_tokens = kv.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit_tokens
    block_ids = kv.allocate_slots(req, num_new_tokens, blocks)
    if block_ids is not None:
        req.num_computed_tokens = num_hit_tokens + num_new_tokens
    return block_ids


def queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def finish(kv: KVCacheManager, *reqs: Request) -> None:
    for req in reqs:
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.req_to_blocks == {}


def test_allocate_caches_full_blocks_of_known_tokens() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    pool = kv.block_pool
    assert [pool.blocks[i].block_hash for i in range(3)] == [*a.block_hashes, None]
    assert kv.num_cached_blocks["a"] == 2
    assert kv.usage == pytest.approx(0.3)
    # Decode: positions 10 and 11 fit in block 2; block 2 is cached once token 11 is known.
    a.append_output_token_ids([50])
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens = 11
    a.append_output_token_ids([51])
    extend_block_hashes(a.block_hashes, a.all_token_ids, BLOCK_SIZE)
    assert kv.allocate_slots(a, 1) == []
    assert pool.blocks[2].block_hash == a.block_hashes[2]
    a.num_computed_tokens = 12
    a.append_output_token_ids([52])
    assert kv.allocate_slots(a, 1) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.check_integrity()
    finish(kv, a)
    # Freed in reverse: unhashed block 3 first in line, the cached tail before the head.
    assert queue_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def test_hits_never_cover_the_last_token() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(12)))
    assert admit(kv, a) == [0, 1, 2]
    # Same 8 tokens: the second block would cover the last token, so only one hit.
    b = request("b", list(range(8)))
    blocks, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0] and num_hit_tokens == 4
    # One more token: both blocks hit, one token left to compute.
    c = request("c", list(range(9)))
    blocks, num_hit_tokens = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit_tokens == 8
    assert admit(kv, c) == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # Lookups alone do not count; each admission adds its tokens once.
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12 + 9, 8)
    finish(kv, a, c)


def test_hit_stops_at_first_divergent_block_and_confirms_tokens() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(12)))
    admit(kv, a)
    b = request("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert kv.get_computed_blocks(b)[1] == 4
    # A forged key (same hashes, other tokens) is not a hit.
    c = request("c", list(range(100, 113)))
    c.block_hashes[:] = a.block_hashes
    assert kv.get_computed_blocks(c) == ([], 0)
    finish(kv, a)


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(28)))
    assert admit(kv, a) == [0, 1, 2, 3, 4, 5, 6]
    b = request("b", list(range(100, 116)))
    assert admit(kv, b) is None
    assert kv.num_free_blocks == 3 and "b" not in kv.req_to_blocks
    assert kv.prefix_cache_queries == 28
    kv.check_integrity()
    finish(kv, a)


def test_free_cached_hits_count_against_free_blocks() -> None:
    """Regression: hits on free cached blocks leave the free queue too, so they must be
    counted before get_new_blocks, which would otherwise run out (or evict the hit)."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    b = request("b", list(range(100, 128)))
    assert admit(kv, b) == [3, 4, 5, 6, 7, 8, 9]
    assert queue_ids(kv) == [2, 1, 0]
    # 3 hits (all free) + 1 new block > 3 free blocks.
    c = request("c", list(range(13)))
    assert kv.get_computed_blocks(c)[1] == 12
    assert admit(kv, c) is None
    assert queue_ids(kv) == [2, 1, 0]
    # 12 tokens: 2 hits + 1 new block; the new one is the LRU front, block 2, evicted
    # and cached again under the same key since its tokens are the same.
    d = request("d", list(range(12)))
    assert admit(kv, d) == [0, 1, 2]
    assert kv.block_pool.blocks[2].block_hash == d.block_hashes[2] == a.block_hashes[2]
    assert kv.num_free_blocks == 0
    finish(kv, b, d)


def test_free_uncaches_blocks_past_num_computed_tokens() -> None:
    """Regression: a request unscheduled in the step that allocated for it leaves blocks whose
    KV was never written; they must not stay cached."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(10)))
    blocks, _ = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 10, blocks) == [0, 1, 2]
    assert len(kv.block_pool.cached_block_map) == 2
    # num_computed_tokens still 0: nothing was computed.
    kv.free(a)
    assert kv.block_pool.cached_block_map == {}
    assert queue_ids(kv) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Computed through token 5: block 0 is kept, block 1 (tokens 4-7) is not.
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 6
    kv.free(a)
    assert list(kv.block_pool.cached_block_map) == [a.block_hashes[0]]
    assert queue_ids(kv) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    finish(kv)


def test_hits_on_blocks_in_use_share_them() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(10)))
    b = request("b", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [0, 1, 3]
    assert kv.num_free_blocks == 6
    kv.free(a)
    # Blocks 0 and 1 are still held by b; only block 2 came back.
    assert queue_ids(kv) == [2, 4, 5, 6, 7, 8, 9]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    finish(kv, b)
    assert queue_ids(kv) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]


def test_caching_disabled() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    assert kv.block_pool.cached_block_map == {}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    finish(kv, a, b)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(10)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(request("b", list(range(10)))) == ([], 0)
    finish(kv)


def test_hits_only_at_admission() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = request("a", list(range(10)))
    admit(kv, a)
    blocks, _ = kv.get_computed_blocks(request("b", list(range(10))))
    with pytest.raises(ValueError, match="already has KV"):
        kv.allocate_slots(a, 1, blocks)
    finish(kv, a)


# ---------------------------------------------------------------------- sliding window


def decode(kv: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step of `req`: its newest token computed, then one more known."""
    block_ids = kv.allocate_slots(req, 1)
    if block_ids is not None:
        req.num_computed_tokens += 1
        req.append_output_token_ids([token])
        extend_block_hashes(req.block_hashes, req.all_token_ids, BLOCK_SIZE)
    return block_ids


def test_a_window_frees_the_blocks_it_has_left_with_exact_ids() -> None:
    """Window 6, blocks of 4: computing position p reads keys p - 5 .. p, so block b goes back
    to the pool once the next position to compute is 4b + 9 or more. While it decodes the
    request holds at most ceil(6 / 4) + 1 = 3 blocks, and exactly those its window reaches."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True, sliding_window=6)
    a = request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]  # positions 0..9
    pool = kv.block_pool.blocks
    held = []
    for step in range(12):
        assert decode(kv, a, 100 + step) is not None
        held.append([b.block_id for b in kv.req_to_blocks["a"] if b is not NULL_BLOCK])
        kv.check_integrity()
    # Position 10 (keys 5..10) no longer reads block 0; 12 takes block 3 (the first free one:
    # block 0 went to the back of the queue); 13 (keys 8..13) leaves block 1; 16 takes block 4
    # (then 5), 17 leaves block 2, 20 takes a sixth place, 21 leaves block 3.
    assert held == [
        [1, 2],
        [1, 2],
        [1, 2, 3],
        [2, 3],
        [2, 3],
        [2, 3],
        [2, 3, 4],
        [3, 4],
        [3, 4],
        [3, 4],
        [3, 4, 5],
        [4, 5],
    ]
    assert pool[0].ref_cnt == pool[1].ref_cnt == pool[2].ref_cnt == 0
    # The list keeps its places, NULL_BLOCK (id 0) where blocks went back; the runner's table
    # lines up with positions.
    places = kv.req_to_blocks["a"]
    assert len(places) == -(-a.num_tokens // BLOCK_SIZE) == 6
    assert places[:4] == [NULL_BLOCK] * 4 and kv.num_held_blocks("a") == 2
    assert max(len(ids) for ids in held) == sliding_window_blocks(6, BLOCK_SIZE, 1) == 3
    finish(kv, a)


def test_a_long_request_fits_a_pool_smaller_than_it_under_a_window() -> None:
    """10 blocks = 40 tokens; under a window of 6 a request decodes to 60 tokens."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=False, sliding_window=6)
    a = request("a", list(range(7)))
    assert admit(kv, a) is not None
    for step in range(53):
        assert decode(kv, a, 200 + step) is not None
        assert kv.num_held_blocks("a") <= 3
        kv.check_integrity()
    assert a.num_tokens == 60
    finish(kv, a)
    without = KVCacheManager(10, BLOCK_SIZE, enable_caching=False)
    b = request("b", list(range(7)))
    admit(without, b)
    steps = 0
    while decode(without, b, 1) is not None:
        steps += 1
    assert steps == 40 - 7  # the full pool, then no block for position 40


def test_a_window_hit_needs_only_the_blocks_its_window_reaches() -> None:
    """A finished request's first blocks lose their keys (evicted for other data); a new
    request with the same prompt still hits 16 of its 17 tokens: the first position it
    computes (16) reads keys 11..16 only, in blocks 2 and 3."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True, sliding_window=6)
    prompt = list(range(17))
    a = request("a", prompt)
    admit(kv, a)  # blocks 0..4, 0..3 cached (full)
    kv.free(a)
    kv.block_pool.uncache_blocks([kv.block_pool.blocks[0], kv.block_pool.blocks[1]])
    b = request("b", prompt)
    blocks, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 16
    assert blocks[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert [blk.block_id for blk in blocks[2:]] == [2, 3]
    assert kv.allocate_slots(b, 1, blocks) is not None
    assert kv.num_held_blocks("b") == 3
    kv.check_integrity()
    # Without the window the same lookup stops at the first missing block.
    plain = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    c = request("c", prompt)
    admit(plain, c)
    plain.free(c)
    plain.block_pool.uncache_blocks([plain.block_pool.blocks[0]])
    assert plain.get_computed_blocks(request("d", prompt))[1] == 0
    finish(kv, b)


def test_a_hit_is_not_taken_where_a_block_inside_the_window_is_missing() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True, sliding_window=6)
    prompt = list(range(17))
    a = request("a", prompt)
    admit(kv, a)
    kv.free(a)
    kv.block_pool.uncache_blocks([kv.block_pool.blocks[2]])  # inside the window of 16
    blocks, num_hit_tokens = kv.get_computed_blocks(request("b", prompt))
    # Hit point 12 needs keys 7..11 (blocks 1, 2): 2 is gone. Hit point 8 needs 3..7 (blocks
    # 0, 1): both cached.
    assert num_hit_tokens == 8 and [blk.block_id for blk in blocks] == [0, 1]
    assert blocks[0] is not NULL_BLOCK


def test_groups_share_the_pool_and_each_keeps_what_its_layers_need() -> None:
    """Two KV cache groups (full attention, and a window of 6) over one pool of 10 blocks: a
    request's two lists have the same places; the full group keeps all of its blocks, the
    sliding one gives back what its window has left, and a new request's hit is taken only
    where both groups have their blocks, each cached under keys of its own."""
    kv = KVCacheManager(10, BLOCK_SIZE, enable_caching=True, group_windows=(0, 6))
    a = request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]  # group 0 (full) first, then group 1
    assert kv.get_group_block_ids("a") == ([3, 4, 5],)
    assert kv.take_new_group_block_ids("a") == ([3, 4, 5],)
    assert kv.take_new_group_block_ids("a") == ([],)
    for step in range(6):
        assert decode(kv, a, 100 + step) is not None
        kv.check_integrity()
    # 16 positions computed: the full group holds 4 blocks (6 taken at position 12); the
    # sliding one gave back block 3 at position 10 and block 4 at 13 (their keys out of the
    # window), and took 7 at 12.
    full, sliding = kv.req_to_blocks["a"], kv.groups[1].req_to_blocks["a"]
    assert [b.block_id for b in full] == [0, 1, 2, 6]
    assert sliding[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert [b.block_id for b in sliding[2:]] == [5, 7]
    assert kv.take_new_group_block_ids("a") == ([7],)
    assert kv.num_held_blocks("a") == 6
    assert kv.block_pool.blocks[3].ref_cnt == kv.block_pool.blocks[4].ref_cnt == 0
    # A second request with a's first 13 tokens hits 12: group 0's chain 0, 1, 2; group 1
    # needs only the keys 7..11 its first computed position reads, blocks 4 (free, still
    # cached: taken back) and 5.
    b = request("b", a.all_token_ids[:13])
    blocks, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 12 and [blk.block_id for blk in blocks] == [0, 1, 2]
    assert kv.allocate_slots(b, 1, blocks) is not None
    b.num_computed_tokens = 13
    b_sliding = kv.groups[1].req_to_blocks["b"]
    assert b_sliding[0] is NULL_BLOCK and [blk.block_id for blk in b_sliding[1:3]] == [4, 5]
    assert kv.block_pool.blocks[4].ref_cnt == 1
    kv.check_integrity()
    kv.free(b)
    # With group 1's block 4 evicted, the hit falls back to where group 1 has its window.
    kv.block_pool.uncache_blocks([kv.block_pool.blocks[4]])
    blocks, num_hit_tokens = kv.get_computed_blocks(request("c", a.all_token_ids[:13]))
    assert num_hit_tokens == 4 and [blk.block_id for blk in blocks] == [0]
    finish(kv, a)
