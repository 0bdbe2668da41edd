"""Metric snapshots as plain dataclasses: what the scheduler reports, what loggers read.

A leaf: imports nothing from octavo, knows nothing of Prometheus or log formats. Cumulative
counters stay cumulative here; exporters turn them into rates or `_total` counters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """One snapshot of the scheduler and its KV cache, taken after a step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks held by requests, 0-1 (vllm:kv_cache_usage_perc).
    kv_cache_usage: float = 0.0
    # Cumulative since start-up.
    num_preemptions: int = 0
    # Cumulative, in tokens: tokens looked up in the prefix cache at admission, and the
    # tokens found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
