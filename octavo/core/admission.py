"""Admission policies: what must hold before a waiting request starts, and whom to evict
when a running request cannot get a block.

A policy is consulted by the scheduler and decides nothing else: it never allocates, frees or
changes a request, and it reads the KV cache manager only through its public counters. The
scheduler keeps the mechanics that every policy shares (the blocks for the next chunk must be
free; preemption frees blocks and sends the victim back to the front of the waiting queue).
"""

from __future__ import annotations

import abc

from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request


class AdmissionPolicy(abc.ABC):
    """The interface the scheduler calls; one instance per scheduler, may keep state."""

    @abc.abstractmethod
    def can_admit(
        self, request: Request, num_new_tokens: int, kv_cache_manager: KVCacheManager
    ) -> bool:
        """Whether the waiting `request` may start this step with a first chunk of
        `num_new_tokens` tokens.

        Called for the request at the front of the waiting queue, after its prefix-cache hits
        have been looked up (the chunk starts right after them, on a block boundary) and
        before any block is allocated. It is an extra condition: the scheduler still requires
        the chunk's blocks to be free. False keeps the request, and every one behind it,
        waiting this step. Must not mutate the request or the manager.
        """

    @abc.abstractmethod
    def select_victim(self, running: list[Request]) -> Request:
        """The request to preempt when a running request cannot get a block.

        `running` is non-empty, in admission order (oldest first), and includes the request
        that needs the block; returning that request means it preempts itself. Must return a
        member of `running` and mutate nothing: the scheduler does the preemption.
        """


class CurrentPolicy(AdmissionPolicy):
    """vLLM's rule: admit while the chunk's blocks are free and, after taking them, at least
    `watermark` of the pool stays free; evict the newest running request.

    The watermark keeps room for running requests to grow into, so that an admission does
    not cause a preemption right away. Hits on free cached blocks are not counted against
    it: those blocks hold the request's own prefix, which it needs in any case.
    """

    def __init__(self, watermark: float = 0.0) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
        self.watermark = watermark

    def can_admit(
        self, request: Request, num_new_tokens: int, kv_cache_manager: KVCacheManager
    ) -> bool:
        if self.watermark == 0.0:
            return True
        watermark_blocks = int(self.watermark * kv_cache_manager.num_blocks)
        num_chunk_blocks = -(-num_new_tokens // kv_cache_manager.block_size)
        return kv_cache_manager.num_free_blocks - num_chunk_blocks >= watermark_blocks

    def select_victim(self, running: list[Request]) -> Request:
        return running[-1]
