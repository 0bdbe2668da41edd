"""RequestStatsTracker: per-request timing state, built from events the engine reports.

The engine tells it, with the time of each event, when a request arrives, is first scheduled,
is evicted, gets tokens and finishes; the tracker turns that into time to first token, gaps
between tokens, each eviction's freeze (eviction -> the request's next token), and one
IterationStats per step with a FinishedRequestStats per finished request. It does the same
for the KV blocks the pool samples (KVBlockEvent): lifetime, idle time and reuse gaps.

A leaf like `metrics.stats`: it reads no clock (every time is an argument, so tests give
exact ones) and knows nothing of the scheduler or of Prometheus. Single-threaded: only the
engine thread calls it. It keeps state only for unfinished requests and live sampled blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from octavo.core.request import FinishReason
from octavo.metrics.stats import FinishedRequestStats, IterationStats, KVBlockEvent

# Prefix hits of a sampled block whose gaps are kept (vLLM keeps the last four accesses).
_NUM_KEPT_ACCESSES = 4


@dataclass(slots=True)
class _RequestTimes:
    """One unfinished request's times so far (vLLM's RequestStateStats)."""

    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    max_token_gap_s: float = 0.0
    num_evictions: int = 0
    # Prefix-cache hits at admission, as the scheduler reported them with the first token.
    num_cached_tokens: int = 0
    # Evictions not yet followed by a token; each one's freeze ends at the next token.
    pending_eviction_times: list[float] = field(default_factory=list)
    eviction_freezes_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _BlockTimes:
    """One sampled KV block's life so far (vLLM's BlockMetricsState)."""

    allocation_time: float
    last_access_time: float
    # Its last prefix hits, oldest first (the allocation is not one).
    access_times: list[float] = field(default_factory=list)


class RequestStatsTracker:
    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        self._blocks: dict[int, _BlockTimes] = {}
        self._iteration = IterationStats()

    def __len__(self) -> int:
        """Requests tracked (unfinished ones)."""
        return len(self._requests)

    def add_request(
        self, request_id: str, arrival_time: float, num_prompt_tokens: int, max_tokens: int
    ) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens, max_tokens)

    def record_scheduled(self, request_ids: Iterable[str], now: float) -> None:
        """Requests sent to the runner in full this step; the first time ends the queueing."""
        for request_id in request_ids:
            times = self._requests.get(request_id)
            if times is not None and times.scheduled_time is None:
                times.scheduled_time = now

    def record_preempted(self, request_ids: Iterable[str], now: float) -> None:
        iteration = self._iteration
        for request_id in request_ids:
            iteration.num_preemptions += 1
            times = self._requests.get(request_id)
            if times is None:
                continue
            if times.num_evictions == 0:
                iteration.num_newly_evicted_reqs += 1
            times.num_evictions += 1
            times.pending_eviction_times.append(now)

    def record_tokens(
        self, request_id: str, num_new_tokens: int, now: float, num_cached_tokens: int = 0
    ) -> None:
        """`num_new_tokens` (> 0) reached the output at `now`. `num_cached_tokens`: the
        request's prompt tokens that came from the prefix cache (read with its first token:
        its prompt is counted then, split into computed and cached)."""
        times = self._requests.get(request_id)
        if times is None or num_new_tokens <= 0:
            return
        iteration = self._iteration
        iteration.num_generation_tokens += num_new_tokens
        if times.first_token_time is None:
            times.first_token_time = now
            times.num_cached_tokens = min(num_cached_tokens, times.num_prompt_tokens)
            iteration.num_prompt_tokens += times.num_prompt_tokens
            iteration.num_cached_prompt_tokens += times.num_cached_tokens
            iteration.time_to_first_tokens_s.append(now - times.arrival_time)
        else:
            gap_s = now - times.last_token_time
            iteration.inter_token_latencies_s.append(gap_s)
            times.max_token_gap_s = max(times.max_token_gap_s, gap_s)
        times.last_token_time = now
        times.num_generation_tokens += num_new_tokens
        for eviction_time in times.pending_eviction_times:
            times.eviction_freezes_s.append(now - eviction_time)
            iteration.eviction_freezes_s.append(now - eviction_time)
        times.pending_eviction_times.clear()

    def record_finished(self, request_id: str, finish_reason: FinishReason, now: float) -> None:
        """The request's end; unknown or already finished ids are ignored."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        arrival = times.arrival_time
        scheduled = times.scheduled_time if times.scheduled_time is not None else now
        first, last = times.first_token_time, times.last_token_time
        self._iteration.finished_requests.append(
            FinishedRequestStats(
                request_id=request_id,
                finish_reason=finish_reason,
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=times.num_generation_tokens,
                max_tokens=times.max_tokens,
                e2e_latency_s=now - arrival,
                queue_time_s=scheduled - arrival,
                ttft_s=None if first is None else first - arrival,
                prefill_time_s=0.0 if first is None else first - scheduled,
                decode_time_s=0.0 if first is None else last - first,
                max_token_gap_s=times.max_token_gap_s,
                num_evictions=times.num_evictions,
                eviction_freezes_s=tuple(times.eviction_freezes_s),
                num_cached_tokens=times.num_cached_tokens,
            )
        )

    def record_block_events(self, events: Iterable[tuple[KVBlockEvent, int]], now: float) -> None:
        """The block pool's (event, block id) of sampled blocks, all at `now`. A block's life
        ends when it is taken for other data: its lifetime, its idle time since its last
        access and the gaps between its kept prefix hits go to the iteration."""
        for event, block_id in events:
            if event is KVBlockEvent.ALLOCATED:
                self._blocks[block_id] = _BlockTimes(now, now)
                continue
            times = self._blocks.get(block_id)
            if times is None:
                continue
            if event is KVBlockEvent.ACCESSED:
                times.last_access_time = now
                times.access_times = [*times.access_times, now][-_NUM_KEPT_ACCESSES:]
            else:
                del self._blocks[block_id]
                iteration = self._iteration
                iteration.kv_block_lifetimes_s.append(now - times.allocation_time)
                iteration.kv_block_idle_before_evict_s.append(now - times.last_access_time)
                hits = times.access_times
                iteration.kv_block_reuse_gaps_s.extend(b - a for a, b in pairwise(hits))

    def record_step(self, step_time_s: float, num_scheduled_prompt_tokens: int) -> None:
        """The step's own time (schedule to outputs) and the prompt-chunk tokens it ran."""
        self._iteration.step_time_s = step_time_s
        self._iteration.num_scheduled_prompt_tokens = num_scheduled_prompt_tokens

    def record_sleep_mode_operation(self, operation: str, duration_s: float) -> None:
        """A sleep or a wake-up of the engine ("sleep" / "wake") and how long it took."""
        self._iteration.sleep_mode_operations_s.append((operation, duration_s))

    def take_iteration_stats(self, num_scheduled_tokens: int = 0) -> IterationStats:
        """Everything recorded since the last call, as one IterationStats; starts a new one."""
        iteration, self._iteration = self._iteration, IterationStats()
        iteration.num_scheduled_tokens = num_scheduled_tokens
        return iteration
