"""KVCacheManager: each request's list of blocks, prefix-cache lookup, allocate and free.

It turns token counts into blocks and blocks into ids for the runner. It owns the per-request
block lists and the prefix-cache counters; the BlockPool owns the blocks themselves. It must
not decide who runs (the scheduler and its admission policy do) and never changes a Request:
it reads `request_id`, `all_token_ids`, `num_computed_tokens` and `block_hashes` only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from octavo.core.block_pool import Block, BlockPool
from octavo.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
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
        blocks: list[Block] = []
        for block_idx, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            begin = block_idx * block_size
            block_tokens = tuple(token_ids[begin : begin + block_size])
            block = self.block_pool.get_cached_block(block_hash, block_tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * block_size

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
        block_size = self.block_size
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * block_size
        num_total_tokens = num_computed + num_new_tokens
        num_required_blocks = -(-num_total_tokens // block_size)
        num_held_blocks = len(held or ()) + len(new_computed_blocks)
        num_new_blocks = max(num_required_blocks - num_held_blocks, 0)
        # A hit on a free cached block takes it out of the free queue as well.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        if held is None:
            held = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * block_size
        # Touch before taking new blocks: a free hit must not be evicted by get_new_blocks.
        self.block_pool.touch(new_computed_blocks)
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
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert the pool is consistent and each block's ref_cnt equals the number of
        requests holding it (so with no request registered, every block is free)."""
        self.block_pool.check_integrity()
        holders = Counter(
            block.block_id for blocks in self.req_to_blocks.values() for block in blocks
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
