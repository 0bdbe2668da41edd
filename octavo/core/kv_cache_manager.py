"""KVCacheManager: each request's list of blocks, prefix-cache lookup, allocate and free.

It turns token counts into blocks and blocks into ids for the runner. It owns the per-request
block lists and the prefix-cache counters; the BlockPool owns the blocks themselves. It must
not decide who runs (the scheduler and its admission policy do) and never changes a Request:
it reads `request_id`, `all_token_ids`, `num_computed_tokens` and `block_hashes` only.

KV cache groups (vLLM's hybrid manager): a model whose layers differ in attention (Gemma's
full and sliding-window layers) has one block list per request for each group of layers
(config.kv_cache_groups), all groups drawing on one pool; a request's lists all have one
place per block of its tokens. In a group with a sliding window W, a block no later query of
the request can see goes back to the pool as soon as the request has computed past it, and its
place holds NULL_BLOCK, so place i still stands for positions i * block_size ..: the group then
holds at most the blocks of the last W positions plus those of the chunk being computed. A
prefix hit is taken at the longest point where every group has what it needs: a full group the
whole chain before it, a sliding group only the cached blocks of the W - 1 positions before it
(the earlier ones may long be gone); each group caches under keys of its own. The runner's
block tables keep their ids for freed places; attention never reads blocks before a window
(AttentionMetadata.for_window), so they are never read there either. Group 0 is what the
scheduler sees (`req_to_blocks`, the ids `allocate_slots` returns); the others' ids travel
beside it (`get_group_block_ids`, `take_new_group_block_ids`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from octavo.core.block_pool import Block, BlockPool
from octavo.core.request import Request
from octavo.metrics.stats import KVBlockEvent

# The place of a block a sliding window has left: not in the pool, never freed or cached; the
# runner's table holds id 0 for it, which attention never reads (its ref_cnt is never 0, so
# the scheduler's count of free hit blocks passes over it).
NULL_BLOCK = Block(0, ref_cnt=1)


def sliding_window_blocks(window: int, block_size: int, num_new_tokens: int) -> int:
    """The most blocks a request under a sliding window holds while it computes a chunk of
    num_new_tokens: those of the window - 1 positions before the chunk and of the chunk, one
    more where they straddle a block edge."""
    return -(-(window - 1 + num_new_tokens) // block_size) + 1


@dataclass
class _Group:
    """One KV cache group's per-request block lists. window: 0 (full attention) or its
    sliding window; salt: 0 for group 0, else mixed into its prefix-cache keys."""

    window: int
    salt: int
    req_to_blocks: dict[str, list[Block]] = field(default_factory=dict)
    # How many leading places of each request have been offered to the prefix cache.
    num_cached_blocks: dict[str, int] = field(default_factory=dict)

    def key(self, block_hash: int) -> int:
        return block_hash if not self.salt else hash((self.salt, block_hash))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int = 0,
        group_windows: tuple[int, ...] | None = None,
        residency_sample: float = 0.0,
    ) -> None:
        """group_windows: each KV cache group's window (0: full attention); None: one group of
        `sliding_window` (0: full), whose blocks before the window go back to the pool as the
        request moves on. residency_sample: the pool's (BlockPool)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        windows = (sliding_window,) if group_windows is None else tuple(group_windows)
        if not windows or min(windows) < 0:
            raise ValueError(f"group windows must be >= 0, got {windows}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, residency_sample)
        self.groups = [_Group(window, salt) for salt, window in enumerate(windows)]
        # Ids appended to groups 1.. since the scheduler last took them, per request.
        self._new_group_ids: dict[str, list[list[int]]] = {}
        # Groups 1..'s hit blocks, from get_computed_blocks for the allocate_slots after it.
        self._group_hits: dict[str, list[list[Block]]] = {}
        # Cumulative, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): one query of
        # request.num_tokens per admission or resume, hits = the tokens served from the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def sliding_window(self) -> int:
        """Group 0's window (a one-group cache's: 0 for full attention)."""
        return self.groups[0].window

    @property
    def num_groups(self) -> int:
        """KV cache groups: a token needs a block place in each (policies count them all, a
        sliding group's as if it kept everything: an upper bound)."""
        return len(self.groups)

    @property
    def req_to_blocks(self) -> dict[str, list[Block]]:
        """Group 0's block lists (every group's have the same places)."""
        return self.groups[0].req_to_blocks

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        return self.groups[0].num_cached_blocks

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

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Groups 1..'s block ids of the request (empty for a one-group cache)."""
        return tuple(
            [block.block_id for block in group.req_to_blocks.get(request_id, ())]
            for group in self.groups[1:]
        )

    def take_new_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Groups 1..'s ids appended since the last call (what the runner has not been sent)."""
        taken = self._new_group_ids.pop(request_id, None)
        return tuple(taken) if taken is not None else tuple([] for _ in self.groups[1:])

    def num_held_blocks(self, request_id: str) -> int:
        """The pool's blocks the request holds across the groups (places a window has left not
        counted)."""
        return sum(
            1
            for group in self.groups
            for block in group.req_to_blocks.get(request_id, ())
            if block is not NULL_BLOCK
        )

    def num_shared_blocks(self, request_id: str) -> int:
        """Of the request's blocks, those other requests hold too (prefix-cache hits, theirs
        on its blocks or its on theirs)."""
        return sum(
            1
            for group in self.groups
            for block in group.req_to_blocks.get(request_id, ())
            if block is not NULL_BLOCK and block.ref_cnt > 1
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Group 0's blocks of the longest prefix-cache hit every group can take, and the
        number of tokens it covers (the other groups' blocks are kept for the allocate_slots
        that follows). Changes nothing in the pool (blocks are taken by `allocate_slots`).

        The hit never covers the last token: the step must compute at least one position to
        have logits to sample from. Without prefix caching, or for a request that asks for
        prompt logprobs (they need the logits of every prompt position, so it recomputes its
        whole prompt, as vLLM's does; its own blocks are still cached for others), or for a
        pooling request that reads every prompt position's hidden state: ([], 0).
        """
        if (
            not self.enable_caching
            or request.sampling_params.prompt_logprobs is not None
            or request.skips_prefix_cache
        ):
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        found = [self._lookup(group, request, max_num_blocks) for group in self.groups]
        num_hit_blocks = max(
            (
                n
                for n in range(len(found[0]) + 1)
                if all(self._can_hit(g, f, n) for g, f in zip(self.groups, found, strict=True))
            ),
            default=0,
        )
        hits = [self._hit_blocks(g, f, num_hit_blocks) for g, f in zip(self.groups, found)]
        if len(hits) > 1:
            self._group_hits[request.request_id] = hits[1:]
        return hits[0], num_hit_blocks * self.block_size

    def _lookup(self, group: _Group, request: Request, max_num_blocks: int) -> list[Block | None]:
        """The group's cached block for each of the request's first full blocks (None where
        there is none; a full group's list stops at its first miss)."""
        block_size = self.block_size
        token_ids = request.all_token_ids
        found: list[Block | None] = []
        for block_idx, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            begin = block_idx * block_size
            block_tokens = tuple(token_ids[begin : begin + block_size])
            block = self.block_pool.get_cached_block(group.key(block_hash), block_tokens)
            if block is None and not group.window:
                break
            found.append(block)
        return found

    def _can_hit(self, group: _Group, found: list[Block | None], num_blocks: int) -> bool:
        """Whether a hit of num_blocks blocks has everything this group needs: the blocks the
        first computed position's window reaches (all of them without a window)."""
        if num_blocks > len(found):  # a full group's chain ended before
            return False
        first = self._skipped(group, num_blocks * self.block_size)
        return all(block is not None for block in found[first:num_blocks])

    def _hit_blocks(self, group: _Group, found: list[Block | None], num_blocks: int) -> list[Block]:
        first = self._skipped(group, num_blocks * self.block_size)
        blocks = [block for block in found[first:num_blocks] if block is not None]
        return [NULL_BLOCK] * first + blocks

    def _skipped(self, group: _Group, num_computed: int) -> int:
        """How many leading blocks no query from position num_computed on can see."""
        if not group.window:
            return 0
        return max(num_computed - group.window + 1, 0) // self.block_size

    def _free_skipped_blocks(self, group: _Group, held: list[Block], num_computed: int) -> None:
        """Give back the held blocks the group's window has left, NULL_BLOCK in their places."""
        end = min(self._skipped(group, num_computed), len(held))
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
        """Make the request's blocks (every group's) cover its tokens up to the end of this step.

        ```
        all_token_ids:   | computed        | hits (new_computed) | num_new_tokens |  ...
                         |<- request.num_computed_tokens ->|     |<- this step  ->|
        blocks:          [ held already   ][ new_computed_blocks ][ from the pool ]
        ```
        `new_computed_blocks` (group 0's, from `get_computed_blocks`) is only given at
        admission, when the request holds no blocks and `num_computed_tokens` is 0.

        Returns the ids of the blocks appended to group 0's list (hits first), possibly empty;
        or None, changing nothing but giving back what windows have left, when the pool cannot
        supply them all. On success, every block that becomes full of known tokens within this
        step's range is cached at once, so that a sibling admitted later in the same step
        already hits it. That is safe because the forward writes a layer's KV for every token
        of the batch before any attention of that layer reads the cache.
        """
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id)
        if new_computed_blocks and (held or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r} already has KV; it cannot take hits.")
        group_hits = self._group_hits.pop(request_id, None) if new_computed_blocks else None
        hits = [list(new_computed_blocks)] + (
            group_hits if group_hits is not None else [[] for _ in self.groups[1:]]
        )
        for group in self.groups:
            group_held = group.req_to_blocks.get(request_id)
            if group_held and group.window:
                # Before counting what is free: what the window has left is free again.
                self._free_skipped_blocks(group, group_held, request.num_computed_tokens)
        block_size = self.block_size
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * block_size
        num_total_tokens = num_computed + num_new_tokens
        num_required_blocks = -(-num_total_tokens // block_size)
        num_places = len(held or ()) + len(new_computed_blocks)
        num_new_blocks = max(num_required_blocks - num_places, 0)
        # A hit on a free cached block takes it out of the free queue as well.
        num_free_hits = sum(1 for blocks in hits for block in blocks if block.ref_cnt == 0)
        if num_new_blocks * len(self.groups) + num_free_hits > self.num_free_blocks:
            return None

        if held is None:
            for group, group_hit in zip(self.groups, hits, strict=True):
                group.req_to_blocks[request_id] = []
                group.num_cached_blocks[request_id] = len(group_hit)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * block_size
        # Touch every group's hits before taking new blocks: a free hit must not be evicted
        # by get_new_blocks.
        for group_hit in hits:
            self.block_pool.touch(block for block in group_hit if block is not NULL_BLOCK)
        appended: list[list[int]] = []
        for group, group_hit in zip(self.groups, hits, strict=True):
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            blocks = group.req_to_blocks[request_id]
            blocks.extend(group_hit)
            blocks.extend(new_blocks)
            self._cache_full_blocks(group, request, min(num_total_tokens, request.num_tokens))
            appended.append([block.block_id for block in (*group_hit, *new_blocks)])
        if len(self.groups) > 1:
            pending = self._new_group_ids.setdefault(request_id, [[] for _ in self.groups[1:]])
            for ids, new_ids in zip(pending, appended[1:], strict=True):
                ids.extend(new_ids)
        return appended[0]

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (every group's) to the pool; a no-op if it holds
        none.

        Call it before resetting `request.num_computed_tokens`: blocks past that count were
        cached at allocation for KV that the current step was going to write. If the step is
        undone for this request (a victim unscheduled in the step that scheduled it), that KV
        never comes, so those blocks lose their keys before they are freed.
        """
        request_id = request.request_id
        self._new_group_ids.pop(request_id, None)
        self._group_hits.pop(request_id, None)
        for group in self.groups:
            blocks = group.req_to_blocks.pop(request_id, None)
            group.num_cached_blocks.pop(request_id, None)
            if not blocks:
                continue
            tail = blocks[request.num_computed_tokens // self.block_size :]
            self.block_pool.uncache_blocks(b for b in tail if b is not NULL_BLOCK)
            # Reverse order: the pool evicts a request's tail before its head.
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def take_residency_events(self) -> list[tuple[KVBlockEvent, int]]:
        """The pool's sampled-block events since the last call (BlockPool)."""
        return self.block_pool.take_residency_events()

    def check_integrity(self) -> None:
        """Assert the pool is consistent, each block's ref_cnt equals the number of request
        lists holding it (so with no request registered, every block is free), and every group
        has the same places for each request."""
        self.block_pool.check_integrity()
        holders = Counter(
            block.block_id
            for group in self.groups
            for blocks in group.req_to_blocks.values()
            for block in blocks
            if block is not NULL_BLOCK
        )
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        for group in self.groups:
            assert group.num_cached_blocks.keys() == group.req_to_blocks.keys()
            assert group.req_to_blocks.keys() == self.req_to_blocks.keys()
            for request_id, blocks in group.req_to_blocks.items():
                assert len(blocks) == len(self.req_to_blocks[request_id]), request_id

    def _cache_full_blocks(self, group: _Group, request: Request, num_known_tokens: int) -> None:
        """Offer to the cache the group's blocks of the request that are full within
        `num_known_tokens`, under the group's keys."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        start = group.num_cached_blocks[request_id]
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
            group.req_to_blocks[request_id][start:end],
            [group.key(h) for h in request.block_hashes[start:end]],
            block_token_ids,
        )
        group.num_cached_blocks[request_id] = end
