"""KVCacheManager: each request's list of blocks, prefix-cache lookup, allocate and free.

It turns token counts into blocks and blocks into ids for the runner. It owns the per-request
block lists and the prefix-cache counters; the BlockPool owns the blocks themselves. It must
not decide who runs (the scheduler and its admission policy do) and never changes a Request:
it reads `request_id`, `all_token_ids`, `num_computed_tokens` and `block_hashes` only.

With a sliding window W (a model whose every layer sees only its last W positions), a block
no later query of its request can see goes back to the pool as soon as the request has
computed past it, and its place in the request's list holds NULL_BLOCK, so list index i still
stands for positions i * block_size ..: a request then holds at most the blocks of its last W
positions plus those of the chunk it computes. A prefix hit needs only the cached blocks of
the W - 1 positions before the hit point (the earlier ones may long be gone). The runner's
block table keeps its ids for the freed places; attention never reads blocks before a window
(AttentionMetadata.for_window), so they are never read there either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from octavo.core.block_pool import Block, BlockPool
from octavo.core.request import Request

# The place of a block a sliding window has left: not in the pool, never freed or cached; the
# runner's table holds id 0 for it, which attention never reads (its ref_cnt is never 0, so
# the scheduler's count of free hit blocks passes over it).
NULL_BLOCK = Block(0, ref_cnt=1)


def sliding_window_blocks(window: int, block_size: int, num_new_tokens: int) -> int:
    """The most blocks a request under a sliding window holds while it computes a chunk of
    num_new_tokens: those of the window - 1 positions before the chunk and of the chunk, one
    more where they straddle a block edge."""
    return -(-(window - 1 + num_new_tokens) // block_size) + 1


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int = 0
    ) -> None:
        """sliding_window: 0, or the window of every layer of the model (its blocks before the
        window are given back as the request moves on)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Cumulative, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): one query of
        # request.num_tokens per admission or resume, hits = the tokens served from the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """The pool's blocks the request holds (its places a window has left not counted)."""
        blocks = self.req_to_blocks.get(request_id, ())
        return sum(1 for block in blocks if block is not NULL_BLOCK)

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest chain of cached blocks that starts the request's tokens, and the number
        of tokens it covers. Changes nothing (blocks are taken by `allocate_slots`).

        The chain never covers the last token: the step must compute at least one position to
        have logits to sample from. Without prefix caching: ([], 0).
        """
        if not self.enable_caching:
            return [], 0
        block_size = self.block_size
        token_ids = request.all_token_ids
        max_num_blocks = (request.num_tokens - 1) // block_size
        if self.sliding_window:
            return self._computed_window_blocks(request, max_num_blocks)
        blocks: list[Block] = []
        for block_idx, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            begin = block_idx * block_size
            block_tokens = tuple(token_ids[begin : begin + block_size])
            block = self.block_pool.get_cached_block(block_hash, block_tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * block_size

    def _computed_window_blocks(
        self, request: Request, max_num_blocks: int
    ) -> tuple[list[Block], int]:
        """get_computed_blocks under a sliding window: the longest hit whose last blocks, those
        the first computed position's window reaches back into, are all cached (a block's key
        chains every block before it, so a cached block vouches for the whole prefix); NULL_BLOCK
        in the places before them."""
        block_size = self.block_size
        token_ids = request.all_token_ids
        found: list[Block | None] = []
        run = best = 0
        for block_idx, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            begin = block_idx * block_size
            block_tokens = tuple(token_ids[begin : begin + block_size])
            block = self.block_pool.get_cached_block(block_hash, block_tokens)
            found.append(block)
            run = run + 1 if block is not None else 0
            if run and run >= block_idx + 1 - self._skipped(begin + block_size):
                best = block_idx + 1
        first = self._skipped(best * block_size)
        blocks = [NULL_BLOCK] * first + [b for b in found[first:best] if b is not None]
        return blocks, best * block_size

    def _skipped(self, num_computed: int) -> int:
        """How many leading blocks no query from position num_computed on can see."""
        if not self.sliding_window:
            return 0
        return max(num_computed - self.sliding_window + 1, 0) // self.block_size

    def _free_skipped_blocks(self, held: list[Block], num_computed: int) -> None:
        """Give back the held blocks the window has left, NULL_BLOCK in their places."""
        end = min(self._skipped(num_computed), len(held))
        start = end
        while start > 0 and held[start - 1] is not NULL_BLOCK:
            start -= 1
        if start == end:
            return
        skipped = held[start:end]
        held[start:end] = [NULL_BLOCK] * (end - start)
        self.block_pool.free_blocks(skipped)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Block] = (),
    ) -> list[int] | None:
        """Make the request's blocks cover its tokens up to the end of this step.

        ```
        all_token_ids:   | computed        | hits (new_computed) | num_new_tokens |  ...
                         |<- request.num_computed_tokens ->|     |<- this step  ->|
        blocks:          [ held already   ][ new_computed_blocks ][ from the pool ]
        ```
        `new_computed_blocks` (from `get_computed_blocks`) is only given at admission, when the
        request holds no blocks and `num_computed_tokens` is 0.

        Returns the ids of the blocks appended to the request's list (hits first), possibly
        empty; or None, changing nothing, when the pool cannot supply them. On success, every
        block that becomes full of known tokens within this step's range is cached at once, so
        that a sibling admitted later in the same step already hits it. That is safe because
        the forward writes a layer's KV for every token of the batch before any attention of
        that layer reads the cache.
        """
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id)
        if new_computed_blocks and (held or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r} already has KV; it cannot take hits.")
        if held and self.sliding_window:
            # Before counting what is free: what the window has left is free again.
            self._free_skipped_blocks(held, request.num_computed_tokens)
        block_size = self.block_size
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * block_size
        num_total_tokens = num_computed + num_new_tokens
        num_required_blocks = -(-num_total_tokens // block_size)
        num_held_blocks = len(held or ()) + len(new_computed_blocks)
        num_new_blocks = max(num_required_blocks - num_held_blocks, 0)
        # A hit on a free cached block takes it out of the free queue as well.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        hit_blocks = [block for block in new_computed_blocks if block is not NULL_BLOCK]
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        if held is None:
            held = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * block_size
        # Touch before taking new blocks: a free hit must not be evicted by get_new_blocks.
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        held.extend(new_computed_blocks)
        held.extend(new_blocks)
        self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return [block.block_id for block in new_computed_blocks] + [
            block.block_id for block in new_blocks
        ]

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool; a no-op if it holds none.

        Call it before resetting `request.num_computed_tokens`: blocks past that count were
        cached at allocation for KV that the current step was going to write. If the step is
        undone for this request (a victim unscheduled in the step that scheduled it), that KV
        never comes, so those blocks lose their keys before they are freed.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        self.block_pool.uncache_blocks(blocks[request.num_computed_tokens // self.block_size :])
        # Reverse order: the pool evicts a request's tail before its head.
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert the pool is consistent and each block's ref_cnt equals the number of
        requests holding it (so with no request registered, every block is free)."""
        self.block_pool.check_integrity()
        holders = Counter(
            block.block_id
            for blocks in self.req_to_blocks.values()
            for block in blocks
            if block is not NULL_BLOCK
        )
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        assert self.num_cached_blocks.keys() == self.req_to_blocks.keys()

    def _cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Offer to the cache the request's blocks that are full within `num_known_tokens`."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        start = self.num_cached_blocks[request_id]
        end = num_known_tokens // self.block_size
        if end <= start:
            return
        if len(request.block_hashes) < end:
            raise ValueError(
                f"request {request_id!r} has {len(request.block_hashes)} block hashes, "
                f"needs {end}: extend them as tokens are appended."
            )
        block_size = self.block_size
        token_ids = request.all_token_ids
        block_token_ids = [
            tuple(token_ids[idx * block_size : (idx + 1) * block_size]) for idx in range(start, end)
        ]
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request_id][start:end],
            request.block_hashes[start:end],
            block_token_ids,
        )
        self.num_cached_blocks[request_id] = end
