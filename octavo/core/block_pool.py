"""BlockPool: the fixed set of KV blocks, their reference counts, the free queue and the
prefix-cache map from block key to block.

The pool owns every Block and decides the eviction order in one place (`free_blocks` and
`get_new_blocks`). It knows nothing of requests, tokens per request or scheduling: callers
hand it blocks and keys. No block is reserved: all `num_blocks` blocks hold KV, so capacity
is `num_blocks * block_size` tokens.

With residency sampling on (vLLM's --kv-cache-metrics), it also reports what happens to a
share of the blocks it hands out, as KVBlockEvents without times: the engine stamps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from octavo.metrics.stats import KVBlockEvent


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    # Requests holding this block. 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Prefix-cache key while the block holds a full, cached block; None otherwise.
    block_hash: int | None = None
    # The cached tokens, kept to confirm a hit (see block_hash.py on collisions).
    token_ids: tuple[int, ...] | None = None
    # Links that only FreeBlockQueue may touch.
    prev_free: Block | None = None
    next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Free blocks in eviction order: the front is taken first.

    Not a deque: a prefix-cache hit on a free block must pull it out of the middle of the
    queue, which is O(n) in a deque but O(1) here because each Block carries its own links.
    Nothing is allocated per operation either. Two sentinel blocks (id -1) bound the list so
    that no operation special-cases an end.
    """

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("popleft from an empty FreeBlockQueue.")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue.")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: Block) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: Block | None, block: Block) -> None:
        assert anchor is not None and anchor.next_free is not None
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue.")
        block.prev_free, block.next_free = anchor, anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[Block]:
        """The queue front to back (for tests and integrity checks; O(n))."""
        blocks = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool, residency_sample: float = 0.0
    ) -> None:
        """residency_sample: the share of allocations whose block's life is reported
        (take_residency_events); 0: none."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        if not 0.0 <= residency_sample <= 1.0:
            raise ValueError(f"residency_sample must be in [0, 1], got {residency_sample}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per key. A second block that fills with the same tokens while the first
        # is cached stays unhashed (its owner keeps using it; it is reused first when freed).
        self.cached_block_map: dict[int, Block] = {}
        # Residency sampling: every allocation adds the share to a credit, and one whose
        # credit reaches 1 is sampled (exactly that share, the same blocks every run).
        self.residency_sample = residency_sample
        self._residency_credit = 0.0
        self._sampled_block_ids: set[int] = set()
        self._residency_events: list[tuple[KVBlockEvent, int]] = []
        # Cumulative: free blocks that still held a cached prefix when taken for new data.
        self.num_evicted_cached_blocks = 0

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` from the front of the free queue, each with ref_cnt 1.

        A taken block that still carried a key is evicted from the prefix cache here, the only
        place eviction happens. Raises ValueError if fewer blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"num_blocks={num_blocks} exceeds the {self.get_num_free_blocks()} free blocks."
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self.num_evicted_cached_blocks += 1
            self._drop_hash(block)
            block.ref_cnt = 1
            if self.residency_sample:
                self._sample_allocation(block.block_id)
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for this key, if its tokens equal `token_ids`; no state changes."""
        block = self.cached_block_map.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free one leaves the
        free queue, so nothing evicts it while it is in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if block.block_id in self._sampled_block_ids:
                self._residency_events.append((KVBlockEvent.ACCESSED, block.block_id))

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        block_token_ids: Sequence[tuple[int, ...]],
    ) -> None:
        """Register newly full blocks under their keys (three parallel sequences).

        A block whose key is already cached by another block stays unhashed. No-op without
        prefix caching.
        """
        if not self.enable_caching:
            return
        for block, block_hash, token_ids in zip(blocks, block_hashes, block_token_ids, strict=True):
            if block.block_hash is not None or block_hash in self.cached_block_map:
                continue
            block.block_hash = block_hash
            block.token_ids = token_ids
            self.cached_block_map[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop the keys of blocks whose KV will not be written after all."""
        for block in blocks:
            self._drop_hash(block)

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Release one reference on each block, in the order given.

        A block reaching ref_cnt 0 goes back to the free queue: an unhashed one to the front
        (it holds nothing worth keeping, so it is reused first), a hashed one to the back (it
        stays a prefix-cache hit until it is taken, in LRU order). Callers pass a request's
        blocks in reverse, so the tail of a prompt is evicted before its head, which keeps the
        cached chains that remain usable.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}.")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.appendleft(block)
            else:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every key; only when no block is held (else False and nothing changes)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.cached_block_map.values():
            block.block_hash = None
            block.token_ids = None
        self.cached_block_map.clear()
        return True

    def get_num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (held by requests or free, reusable until taken)."""
        return len(self.cached_block_map)

    def take_residency_events(self) -> list[tuple[KVBlockEvent, int]]:
        """The (event, block id) of sampled blocks since the last call, in order; empty
        without residency sampling."""
        events, self._residency_events = self._residency_events, []
        return events

    def _sample_allocation(self, block_id: int) -> None:
        """A block taken for new data: the end of its sampled life, if it had one, and maybe
        the start of a new one."""
        if block_id in self._sampled_block_ids:
            self._sampled_block_ids.remove(block_id)
            self._residency_events.append((KVBlockEvent.EVICTED, block_id))
        self._residency_credit += self.residency_sample
        if self._residency_credit >= 1.0:
            self._residency_credit -= 1.0
            self._sampled_block_ids.add(block_id)
            self._residency_events.append((KVBlockEvent.ALLOCATED, block_id))

    def check_integrity(self) -> None:
        """Assert that the free queue, the ref counts and the key map agree."""
        free_blocks = self.free_block_queue.get_all_free_blocks()
        assert len(free_blocks) == self.get_num_free_blocks()
        free_ids = {block.block_id for block in free_blocks}
        assert len(free_ids) == len(free_blocks), "a block is in the free queue twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), block
            if block.block_hash is not None:
                assert self.cached_block_map.get(block.block_hash) is block, block
                assert block.token_ids is not None, block
        for block_hash, block in self.cached_block_map.items():
            assert block.block_hash == block_hash, block

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_map.get(block.block_hash) is block:
            del self.cached_block_map[block.block_hash]
        block.block_hash = None
        block.token_ids = None
