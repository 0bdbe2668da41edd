"""kv_snapshot: what the KV cache holds right now and who holds it, as plain data (GET /v1/kv
and `octavo top` read it).

One dictionary of ints, floats and strings (it crosses the engine-core process boundary in
msgpack as it is): the pool (blocks in all, free, holding a cached prefix), the cumulative
counters (preemptions, cached blocks evicted, prefix-cache queries and hits in tokens) and one
entry per unfinished request, running ones first in admission order, then the waiting queue in
its order.

Must not: change anything (it only reads the scheduler, between steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from octavo.core.request import Request

if TYPE_CHECKING:
    from octavo.core.scheduler import Scheduler


def kv_snapshot(scheduler: Scheduler) -> dict[str, Any]:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    return {
        "block_size": scheduler.block_size,
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "num_cached_blocks": pool.get_num_cached_blocks(),
        "usage": kv.usage,
        "num_running_reqs": len(scheduler.running),
        "num_waiting_reqs": len(scheduler.waiting),
        "num_preemptions": scheduler.num_preemptions,
        "num_evicted_cached_blocks": pool.num_evicted_cached_blocks,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "requests": [
            _request_entry(scheduler, request)
            for request in (*scheduler.running, *scheduler.waiting)
        ],
    }


def _request_entry(scheduler: Scheduler, request: Request) -> dict[str, Any]:
    kv = scheduler.kv_cache_manager
    request_id = request.request_id
    return {
        "request_id": request_id,
        "state": request.status.name.lower(),
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_tokens": request.num_output_tokens,
        "max_tokens": request.max_tokens,
        # Prompt tokens found in the prefix cache at first admission (0 before it).
        "num_cached_tokens": max(request.num_cached_tokens, 0),
        "num_blocks": kv.num_held_blocks(request_id),
        "num_shared_blocks": kv.num_shared_blocks(request_id),
        "num_preemptions": request.num_preemptions,
    }
