"""RequestStatsTracker on hand-given times (binary fractions, so every value is exact):
TTFT, gaps, evictions and their freezes, and the finished-request record."""

from __future__ import annotations

from octavo.metrics.stats import FinishedRequestStats, IterationStats, KVBlockEvent
from octavo.metrics.tracker import RequestStatsTracker


def test_a_request_evicted_once_and_one_aborted() -> None:
    tracker = RequestStatsTracker()
    tracker.add_request("a", arrival_time=10.0, num_prompt_tokens=5, max_tokens=8)
    tracker.add_request("b", arrival_time=10.5, num_prompt_tokens=3, max_tokens=4)
    assert len(tracker) == 2

    # Step 1: both scheduled at 11.0, first tokens at 11.5; a had found 4 of its 5 prompt
    # tokens in the prefix cache (counted with its first token, once).
    tracker.record_scheduled(["a", "b"], 11.0)
    tracker.record_tokens("a", 1, 11.5, num_cached_tokens=4)
    tracker.record_tokens("b", 1, 11.5)
    assert tracker.take_iteration_stats(8) == IterationStats(
        num_scheduled_tokens=8,
        num_prompt_tokens=8,
        num_cached_prompt_tokens=4,
        num_generation_tokens=2,
        time_to_first_tokens_s=[1.5, 1.0],
    )

    # Step 2 starts at 12.0 and evicts b; a gets a token at 12.5.
    tracker.record_preempted(["b"], 12.0)
    tracker.record_tokens("a", 1, 12.5, num_cached_tokens=4)
    assert tracker.take_iteration_stats(1) == IterationStats(
        num_scheduled_tokens=1,
        num_generation_tokens=1,
        num_preemptions=1,
        num_newly_evicted_reqs=1,
        inter_token_latencies_s=[1.0],
    )

    # b is resumed at 13.0 (its queue time stays the first one) and gets a token at 14.0:
    # a 2.0 s freeze and a 2.5 s gap. Both finish.
    tracker.record_tokens("a", 1, 12.75)
    tracker.record_scheduled(["b"], 13.0)
    tracker.record_tokens("b", 1, 14.0)
    tracker.record_finished("b", "length", 14.0)
    tracker.record_finished("a", "abort", 15.0)
    tracker.record_finished("nobody", "stop", 15.0)
    iteration = tracker.take_iteration_stats()
    assert iteration.inter_token_latencies_s == [0.25, 2.5]
    assert iteration.eviction_freezes_s == [2.0]
    assert iteration.finished_requests == [
        FinishedRequestStats(
            request_id="b",
            finish_reason="length",
            num_prompt_tokens=3,
            num_generation_tokens=2,
            max_tokens=4,
            e2e_latency_s=3.5,
            queue_time_s=0.5,
            ttft_s=1.0,
            prefill_time_s=0.5,
            decode_time_s=2.5,
            max_token_gap_s=2.5,
            num_evictions=1,
            eviction_freezes_s=(2.0,),
        ),
        FinishedRequestStats(
            request_id="a",
            finish_reason="abort",
            num_prompt_tokens=5,
            num_generation_tokens=3,
            max_tokens=8,
            e2e_latency_s=5.0,
            queue_time_s=1.0,
            ttft_s=1.5,
            prefill_time_s=0.5,
            decode_time_s=1.25,
            max_token_gap_s=1.0,
            num_evictions=0,
            num_cached_tokens=4,
        ),
    ]
    assert len(tracker) == 0
    assert tracker.take_iteration_stats() == IterationStats()


def test_two_evictions_before_a_token_and_a_request_without_tokens() -> None:
    tracker = RequestStatsTracker()
    tracker.add_request("a", 0.0, 4, 16)
    tracker.add_request("w", 1.0, 4, 16)
    tracker.record_scheduled(["a"], 0.5)
    tracker.record_preempted(["a"], 1.0)
    tracker.record_scheduled(["a"], 1.5)
    tracker.record_preempted(["a"], 2.0)
    tracker.record_tokens("a", 1, 5.0)
    tracker.record_finished("a", "stop", 5.0)
    tracker.record_finished("w", "abort", 4.0)
    iteration = tracker.take_iteration_stats()
    # Each eviction ends at the next token; the request counts once as evicted.
    assert (iteration.num_preemptions, iteration.num_newly_evicted_reqs) == (2, 1)
    assert iteration.eviction_freezes_s == [4.0, 3.0]
    a, w = iteration.finished_requests
    assert (a.num_evictions, a.eviction_freezes_s, a.ttft_s, a.max_token_gap_s) == (
        2,
        (4.0, 3.0),
        5.0,
        0.0,
    )
    # Never scheduled: it queued until the abort; no token, no TTFT.
    assert (w.ttft_s, w.queue_time_s, w.e2e_latency_s, w.prefill_time_s) == (None, 3.0, 3.0, 0.0)
    assert w.num_generation_tokens == 0 and iteration.num_prompt_tokens == 4


def test_sampled_block_lives() -> None:
    """Block 7 is allocated at 1.0, hit at 2.0, 2.5, 4.0, 4.5 and 6.0 (the last four hits are
    kept), and taken for other data at 8.0: lifetime 7, idle 2, gaps between the kept hits.
    Block 3's life has not ended, and events of an unknown block are ignored."""
    tracker = RequestStatsTracker()
    tracker.record_block_events([(KVBlockEvent.ALLOCATED, 7), (KVBlockEvent.ACCESSED, 9)], 1.0)
    tracker.record_block_events([(KVBlockEvent.ACCESSED, 7), (KVBlockEvent.ALLOCATED, 3)], 2.0)
    for now in (2.5, 4.0, 4.5, 6.0):
        tracker.record_block_events([(KVBlockEvent.ACCESSED, 7)], now)
    assert tracker.take_iteration_stats() == IterationStats()
    tracker.record_block_events([(KVBlockEvent.EVICTED, 7), (KVBlockEvent.EVICTED, 9)], 8.0)
    assert tracker.take_iteration_stats() == IterationStats(
        kv_block_lifetimes_s=[7.0],
        kv_block_idle_before_evict_s=[2.0],
        kv_block_reuse_gaps_s=[1.5, 0.5, 1.5],
    )
