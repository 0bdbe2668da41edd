"""Scheduler: schedule() -> fake runner output -> update(), on 10 blocks of 4 tokens.

Every test ends with assert_all_free: all requests finished or aborted, no block leaked.
"""

from __future__ import annotations

import random

import pytest

from octavo.core.admission import CurrentPolicy
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.request import Request, RequestStatus

from .utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    create_requests,
    create_scheduler,
    fake_runner_output,
    free_queue_ids,
    ids,
    make_request,
    ref_cnts,
    step,
)

# --- budget, chunks, admission ----------------------------------------------------------------


def test_prompt_then_decode() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=10)
    scheduler.add_request(a)
    assert len(a.block_hashes) == 2

    out, core_outputs = step(scheduler, {"0": [50]})
    (new,) = out.scheduled_new_reqs
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("0", [0, 1, 2], 0)
    assert new.prompt_token_ids == list(range(1000, 1010)) and new.output_token_ids == []
    assert out.num_scheduled_tokens == {"0": 10} and out.total_num_scheduled_tokens == 10
    assert a.num_computed_tokens == 10 and a.num_cached_tokens == 0
    (core_output,) = core_outputs
    assert (core_output.request_id, core_output.new_token_ids) == ("0", [50])
    assert core_output.finish_reason is None and core_output.num_cached_tokens == 0

    # Position 10: a decode, no new block; the CachedRequestData count is from before the step.
    out, _ = step(scheduler, {"0": [51]})
    (cached,) = out.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([], 10)
    assert out.scheduled_new_reqs == [] and out.num_scheduled_tokens == {"0": 1}
    # Position 11 fills block 2, which is cached at allocation.
    out, _ = step(scheduler, {"0": [52]})
    assert out.scheduled_cached_reqs[0].new_block_ids == []
    assert len(a.block_hashes) == 3
    assert scheduler.kv_cache_manager.block_pool.blocks[2].block_hash == a.block_hashes[2]
    # Position 12 needs a fourth block.
    out, _ = step(scheduler, {"0": [53]})
    assert out.scheduled_cached_reqs[0].new_block_ids == [3]
    assert a.output_token_ids == [50, 51, 52, 53] and a.num_computed_tokens == 13
    scheduler.check_integrity()
    assert_all_free(scheduler)


def test_long_prompt_is_chunked_to_the_budget() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=8)
    a, b = create_requests(2, num_tokens=[10, 6])
    scheduler.add_request(a)
    scheduler.add_request(b)

    out, core_outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 8}
    assert out.scheduled_new_reqs[0].block_ids == [0, 1]
    assert core_outputs == [] and a.num_computed_tokens == 8 and ids(scheduler.waiting) == ["1"]

    out, core_outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 2, "1": 6} and out.total_num_scheduled_tokens == 8
    (cached,) = out.scheduled_cached_reqs
    assert (cached.request_id, cached.new_block_ids, cached.num_computed_tokens) == ("0", [2], 8)
    assert out.scheduled_new_reqs[0].block_ids == [3, 4]
    assert [o.request_id for o in core_outputs] == ["0", "1"]

    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1}
    assert_all_free(scheduler)


def test_decodes_come_first_and_prefill_takes_the_rest_of_the_budget() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=6)
    a, b = create_requests(2, num_tokens=[4, 13])
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 5}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 5}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 3}
    assert b.num_computed_tokens == 13 and b.num_output_tokens == 1
    assert_all_free(scheduler)


def test_max_num_seqs() -> None:
    scheduler = create_scheduler(max_num_seqs=2)
    for request in create_requests(3, num_tokens=4, max_tokens=2):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 4, "1": 4}
    out, core_outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1}
    assert [o.finish_reason for o in core_outputs] == ["length", "length"]
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"2": 4} and out.finished_req_ids == {"0", "1"}
    assert_all_free(scheduler)


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    scheduler = create_scheduler()
    a, b, c = create_requests(3, num_tokens=[28, 16, 4])
    for request in (a, b, c):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    # b needs 4 blocks, 3 are free; c would fit but does not skip ahead.
    assert out.num_scheduled_tokens == {"0": 28}
    assert ids(scheduler.waiting) == ["1", "2"] and scheduler.kv_cache_manager.num_free_blocks == 3
    assert_all_free(scheduler)


def test_watermark_keeps_a_share_of_the_pool_free() -> None:
    scheduler = create_scheduler(policy=CurrentPolicy(watermark=0.5))
    a, b = create_requests(2, num_tokens=[16, 8])
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler)
    # 10 - 4 = 6 >= 5 blocks free after a; after b it would be 4 < 5.
    assert out.num_scheduled_tokens == {"0": 16} and ids(scheduler.waiting) == ["1"]
    with pytest.raises(ValueError, match="watermark"):
        CurrentPolicy(watermark=1.0)
    assert_all_free(scheduler)


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = create_scheduler()
    scheduler.add_request(make_request("x", [1, 2, 3]))
    with pytest.raises(ValueError, match="'x'"):
        scheduler.add_request(make_request("x", [1, 2, 3]))
    assert_all_free(scheduler)


# --- prefix caching ---------------------------------------------------------------------------


def test_prefix_hits_and_the_last_token_is_recomputed() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=8, max_tokens=1)
    scheduler.add_request(a)
    step(scheduler)
    # Freed after one token: hashed tail first at the back.
    assert free_queue_ids(scheduler) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]

    b = make_request("b", list(a.prompt_token_ids))
    c = make_request("c", [*a.prompt_token_ids, 5])
    scheduler.add_request(b)
    scheduler.add_request(c)
    out, core_outputs = step(scheduler)
    # b: 8 tokens cached, but the last one is recomputed -> 1 block hit, 4 tokens run.
    # c: both blocks hit, 1 token run.
    new_b, new_c = out.scheduled_new_reqs
    assert (new_b.block_ids, new_b.num_computed_tokens) == ([0, 2], 4)
    assert (new_c.block_ids, new_c.num_computed_tokens) == ([0, 1, 3], 8)
    assert out.num_scheduled_tokens == {"b": 4, "c": 1}
    assert ref_cnts(scheduler, [0, 1, 2, 3]) == [2, 1, 1, 1]
    assert [o.num_cached_tokens for o in core_outputs] == [4, 8]
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 8 + 9, 12)
    assert_all_free(scheduler)


def test_freed_cached_blocks_are_reused_on_a_hit_and_evicted_in_lru_order() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=12, max_tokens=1)
    scheduler.add_request(a)
    step(scheduler)
    assert free_queue_ids(scheduler) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].block_hash for i in (0, 1, 2)] == a.block_hashes

    b = make_request("b", list(range(2000, 2027)))
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.scheduled_new_reqs[0].block_ids == [3, 4, 5, 6, 7, 8, 9]
    assert free_queue_ids(scheduler) == [2, 1, 0]

    # c shares a's first 8 tokens: blocks 0 and 1 are hits pulled from the queue; its third
    # block is the LRU front, block 2, whose cached contents are evicted now.
    c = make_request("c", [*a.prompt_token_ids[:8], 77, 78, 79, 80])
    scheduler.add_request(c)
    out, _ = step(scheduler)
    new_c = out.scheduled_new_reqs[0]
    assert (new_c.block_ids, new_c.num_computed_tokens) == ([0, 1, 2], 8)
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}
    assert a.block_hashes[2] not in pool.cached_block_map
    assert pool.blocks[2].block_hash == c.block_hashes[2]
    assert free_queue_ids(scheduler) == []
    assert_all_free(scheduler)


def test_siblings_share_blocks_in_the_same_step() -> None:
    scheduler = create_scheduler()
    for request in create_requests(3, num_tokens=10, same_prompt=True):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert [(n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ([0, 1, 2], 0),
        ([0, 1, 3], 8),
        ([0, 1, 4], 8),
    ]
    assert out.num_scheduled_tokens == {"0": 10, "1": 2, "2": 2}
    assert ref_cnts(scheduler, [0, 1, 2, 3, 4]) == [3, 3, 1, 1, 1]
    assert [scheduler.get_request(i).num_cached_tokens for i in "012"] == [0, 8, 8]
    assert_all_free(scheduler)


def test_no_sharing_without_prefix_caching() -> None:
    scheduler = create_scheduler(enable_prefix_caching=False)
    for request in create_requests(2, num_tokens=10, same_prompt=True):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0, 1, 2], [3, 4, 5]]
    assert scheduler.get_request("0").block_hashes == []
    assert_all_free(scheduler)


def test_reset_prefix_cache() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=10, max_tokens=2)
    scheduler.add_request(a)
    step(scheduler)
    assert scheduler.reset_prefix_cache() is False
    step(scheduler)
    assert a.is_finished and scheduler.reset_prefix_cache() is True
    b = make_request("b", list(a.prompt_token_ids))
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert_all_free(scheduler)


# --- preemption -------------------------------------------------------------------------------


def test_preemption_of_the_newest_and_fcfs_resume() -> None:
    scheduler = create_scheduler()
    a, b, c = create_requests(3, num_tokens=[16, 12, 8])
    for request in (a, b, c):
        scheduler.add_request(request)
    out, _ = step(scheduler, {"0": [50], "1": [51], "2": [52]})
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0, 1, 2, 3], [4, 5, 6], [7, 8]]

    d = make_request("d", [1, 2, 3])
    scheduler.add_request(d)
    # a takes the last free block (9); b needs one more, so c (newest) is preempted. c's
    # blocks return hashed, tail first ([8, 7]) and b takes block 8. Nothing is admitted.
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"2"}
    assert out.num_scheduled_tokens == {"0": 1, "1": 1} and out.total_num_scheduled_tokens == 2
    assert [(r.request_id, r.new_block_ids) for r in out.scheduled_cached_reqs] == [
        ("0", [9]),
        ("1", [8]),
    ]
    assert ids(scheduler.waiting) == ["2", "d"] and ids(scheduler.running) == ["0", "1"]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [52] and scheduler.make_stats().num_preemptions == 1
    assert free_queue_ids(scheduler) == [7]
    scheduler.check_integrity()

    # c (9 tokens) hits block 7 only, needs 2 more blocks: it waits, and so does d behind it.
    out, _ = step(scheduler, EOS_TOKEN_ID)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1} and out.preempted_req_ids == set()
    assert a.is_finished and b.is_finished

    # Resumed: sent in full again, with its output token, recomputing from the hit.
    out, _ = step(scheduler)
    assert out.finished_req_ids == {"0", "1"}
    new_c, new_d = out.scheduled_new_reqs
    assert new_c.request_id == "2" and new_c.output_token_ids == [52]
    assert new_d.request_id == "d" and new_d.num_computed_tokens == 0
    assert new_c.prompt_token_ids == c.prompt_token_ids and new_c.num_computed_tokens == 4
    assert new_c.block_ids[0] == 7
    assert out.num_scheduled_tokens == {"2": 5, "d": 3}
    # num_cached_tokens is from the first admission, not the resume.
    assert c.num_cached_tokens == 0 and c.num_output_tokens == 2
    assert_all_free(scheduler)


def test_a_request_that_is_the_newest_preempts_itself() -> None:
    scheduler = create_scheduler()
    a, b = create_requests(2, num_tokens=[15, 24])
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler)
    # a's position 15 fits in its block 3; b's position 24 needs a block, none is free, and
    # the newest running request is b itself.
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"1"} and out.num_scheduled_tokens == {"0": 1}
    assert out.scheduled_cached_reqs[0].new_block_ids == []
    assert ids(scheduler.waiting) == ["1"] and b.status == RequestStatus.PREEMPTED
    assert free_queue_ids(scheduler) == [9, 8, 7, 6, 5, 4]
    assert_all_free(scheduler)


# --- scheduling policy: fcfs | priority -------------------------------------------------------


@pytest.mark.parametrize(
    "scheduling_policy,order",
    [("fcfs", ["a", "b", "c", "d", "e"]), ("priority", ["b", "d", "e", "a", "c"])],
)
def test_waiting_order_by_scheduling_policy(scheduling_policy: str, order: list[str]) -> None:
    """priority: lower values first, then earlier arrivals (e arrived first, though it was
    added last); fcfs ignores priorities. One request runs at a time, so the admission order
    is the queue's."""
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy=scheduling_policy)
    added = [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", 1, -1.0)]
    for idx, (request_id, priority, arrival_time) in enumerate(added):
        prompt = [100 * (idx + 1) + t for t in range(4)]
        scheduler.add_request(
            make_request(request_id, prompt, 1, priority=priority, arrival_time=arrival_time)
        )
    assert ids(scheduler.waiting) == order
    scheduler.check_integrity()
    admitted = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        admitted += ids(out.scheduled_new_reqs)
    assert admitted == order
    assert_all_free(scheduler)


@pytest.mark.parametrize(
    "scheduling_policy,preempted,scheduled,waiting",
    [
        ("fcfs", "2", {"0": 1, "1": 1}, ["2", "d"]),
        ("priority", "0", {"1": 1, "2": 1}, ["d", "0"]),
    ],
)
def test_victim_under_memory_pressure_by_scheduling_policy(
    scheduling_policy: str, preempted: str, scheduled: dict[str, int], waiting: list[str]
) -> None:
    """a (priority 2) runs first and grows to 5 blocks; b (0) and c (1) join with 3 + 2, and
    the pool is full. Then b needs a block. fcfs evicts the newest (c). priority evicts the
    least important, a, although it is the oldest and its decode was already scheduled in
    this step (undone), and puts it back at its place by priority: behind d (priority 0)."""
    scheduler = create_scheduler(scheduling_policy=scheduling_policy)
    a, b, c = (
        make_request(str(idx), [1000 * (idx + 1) + t for t in range(length)], priority=priority)
        for idx, (length, priority) in enumerate([(16, 2), (12, 0), (8, 1)])
    )
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    scheduler.add_request(c)
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["1", "2"]
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    scheduler.add_request(make_request("d", [1, 2, 3], priority=0, arrival_time=5.0))
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {preempted} and out.num_scheduled_tokens == scheduled
    assert out.scheduled_new_reqs == []  # a step that preempted admits nothing
    assert ids(scheduler.waiting) == waiting
    assert scheduler.requests[preempted].status == RequestStatus.PREEMPTED
    scheduler.check_integrity()
    assert_all_free(scheduler)


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_a_waiting_request_never_preempts_a_running_one(scheduling_policy: str) -> None:
    """vLLM's rule under both policies: a waiting request that finds too few free blocks
    waits, whatever its priority; only a running request that needs a block evicts. Here a
    (priority 5) holds 9 of 10 blocks and takes the last one; b (priority -5) needs 2."""
    scheduler = create_scheduler(scheduling_policy=scheduling_policy)
    a = make_request("a", list(range(36)), max_tokens=2, priority=5)
    scheduler.add_request(a)
    step(scheduler)
    b = make_request("b", list(range(50, 58)), priority=-5, arrival_time=1.0)
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == set() and out.num_scheduled_tokens == {"a": 1}
    assert ids(scheduler.waiting) == ["b"] and a.is_finished
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["b"]
    assert_all_free(scheduler)


def test_no_admission_in_a_step_that_preempted() -> None:
    """A victim that would fit again at once (its hits are on blocks another request holds)
    still waits a step: the runner must not be told to drop and re-add it in one output."""
    scheduler = create_scheduler(num_blocks=5)
    v = make_request("v", [*range(10, 18), 7, 7, 7, 7, 20])
    s = make_request("s", list(range(10, 18)))
    scheduler.add_request(v)
    scheduler.add_request(s)
    out, _ = step(scheduler)
    # s hits block 0 only (its last token is recomputed); its block 4 repeats v's block 1,
    # whose key is taken, so block 4 stays unhashed.
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0, 1, 2, 3], [0, 4]]
    assert scheduler.kv_cache_manager.block_pool.blocks[4].block_hash is None

    # s (newest) needs a block for position 8 and preempts itself. Its hits would now be
    # blocks 0 and 1, both held by v, plus one free block: it would fit, but waits.
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"s"} and out.num_scheduled_tokens == {"v": 1}
    assert out.scheduled_new_reqs == [] and ids(scheduler.waiting) == ["s"]
    assert free_queue_ids(scheduler) == [4]

    out, _ = step(scheduler)
    (new_s,) = out.scheduled_new_reqs
    assert (new_s.block_ids, new_s.num_computed_tokens, new_s.output_token_ids) == (
        [0, 1, 4],
        8,
        [7],
    )
    assert out.num_scheduled_tokens == {"v": 1, "s": 1}
    assert ref_cnts(scheduler, [0, 1, 2, 3, 4]) == [2, 2, 1, 1, 1]
    assert_all_free(scheduler)


class OldestVictimPolicy(CurrentPolicy):
    """Evicts the oldest running request, which may already be scheduled this step."""

    def select_victim(self, running: list[Request]) -> Request:
        return running[0]


def test_unscheduling_a_victim_already_scheduled_this_step() -> None:
    """Regression: a victim scheduled earlier in the step must give back its tokens and its
    block delta and leave the output."""
    scheduler = create_scheduler(policy=OldestVictimPolicy())
    a, b = create_requests(2, num_tokens=[15, 24])
    for request in (a, b):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.blocks[3].block_hash is None

    # a runs position 15, which fills block 3 (cached at allocation); then b needs a block
    # and the policy names a. a is unscheduled: its block 3 loses the key (its KV never
    # comes), goes to the front, and b takes it.
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"0"}
    assert out.num_scheduled_tokens == {"1": 1} and out.total_num_scheduled_tokens == 1
    assert [(r.request_id, r.new_block_ids) for r in out.scheduled_cached_reqs] == [("1", [3])]
    assert a.block_hashes[3] not in pool.cached_block_map
    assert [pool.cached_block_map.get(h) for h in a.block_hashes[:3]] == pool.blocks[:3]
    assert free_queue_ids(scheduler) == [2, 1, 0]
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 25
    scheduler.check_integrity()
    assert_all_free(scheduler)


def test_unscheduled_victim_leaves_no_key_on_unwritten_kv() -> None:
    """Regression: blocks cached when a decode was scheduled must lose their key if that
    decode is undone in the same step; otherwise a later hit reads KV that was never written.
    Here a's freed block 3 is not taken again at once, because b (sharing a's first blocks)
    still does not fit and preempts itself."""
    scheduler = create_scheduler(
        num_blocks=5, max_num_batched_tokens=16, policy=OldestVictimPolicy()
    )
    a = make_request("a", list(range(15)))
    b = make_request("b", [*range(12), *range(50, 62)])
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler)
    # b hits a's blocks 0-2, cached at a's allocation in this same step, and gets 1 token.
    assert [(n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ([0, 1, 2, 3], 0),
        ([0, 1, 2, 4], 12),
    ]
    assert out.num_scheduled_tokens == {"a": 15, "b": 1}

    # a's decode fills block 3 (cached at allocation). b needs 2 blocks: a is preempted
    # (only its block 3 comes free, 0-2 are b's too), then b preempts itself.
    pool = scheduler.kv_cache_manager.block_pool
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"a", "b"} and out.num_scheduled_tokens == {}
    assert out.is_empty and out.scheduled_cached_reqs == []
    assert pool.blocks[3].block_hash is None and a.block_hashes[3] not in pool.cached_block_map
    assert set(pool.cached_block_map) == set(a.block_hashes[:3])
    assert free_queue_ids(scheduler) == [4, 3, 2, 1, 0]
    # Each victim goes to the front: with this policy, the newest ends up first.
    assert ids(scheduler.waiting) == ["b", "a"]

    scheduler.abort_requests(["b"])
    out, _ = step(scheduler)
    # a resumes from its cached blocks 0-2 and recomputes position 12 on.
    (new_a,) = out.scheduled_new_reqs
    assert (new_a.block_ids, new_a.num_computed_tokens, new_a.output_token_ids) == (
        [0, 1, 2, 4],
        12,
        [7],
    )
    assert out.num_scheduled_tokens == {"a": 4}
    assert_all_free(scheduler)


# --- stops ------------------------------------------------------------------------------------


def test_eos_and_user_stop_tokens() -> None:
    scheduler = create_scheduler()
    a, b, c = create_requests(3, num_tokens=4, stop_token_ids=[9])
    for request in (a, b, c):
        scheduler.add_request(request)
    _, core_outputs = step(scheduler, {"0": [EOS_TOKEN_ID], "1": [9], "2": [7]})
    assert [(o.finish_reason, o.stop_reason) for o in core_outputs] == [
        ("stop", None),
        ("stop", 9),
        (None, None),
    ]
    assert a.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 9
    # Blocks are freed at once; ids reported in the next step.
    assert ids(scheduler.running) == ["2"] and scheduler.kv_cache_manager.num_free_blocks == 9
    assert scheduler.get_request("0") is None
    out, _ = step(scheduler)
    assert out.finished_req_ids == {"0", "1"}
    assert_all_free(scheduler)


def test_min_tokens_defers_stop_tokens() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=4, min_tokens=2, stop_token_ids=[9])
    scheduler.add_request(a)
    _, (first,) = step(scheduler, {"0": [EOS_TOKEN_ID]})
    assert first.finish_reason is None
    _, (second,) = step(scheduler, {"0": [9]})
    assert (second.finish_reason, second.stop_reason) == ("stop", 9)
    assert a.output_token_ids == [EOS_TOKEN_ID, 9]
    assert_all_free(scheduler)


def test_ignore_eos_request_runs_to_max_tokens() -> None:
    scheduler = create_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=2, eos_token_id=None, ignore_eos=True)
    scheduler.add_request(a)
    step(scheduler, EOS_TOKEN_ID)
    _, (output,) = step(scheduler, EOS_TOKEN_ID)
    assert (output.finish_reason, a.status) == ("length", RequestStatus.FINISHED_LENGTH_CAPPED)
    assert a.output_token_ids == [EOS_TOKEN_ID, EOS_TOKEN_ID]
    assert_all_free(scheduler)


def test_max_model_len_caps_length() -> None:
    scheduler = create_scheduler(max_model_len=12)
    (a,) = create_requests(1, num_tokens=10, max_tokens=16)
    scheduler.add_request(a)
    step(scheduler)
    _, (output,) = step(scheduler)
    assert output.finish_reason == "length" and a.num_tokens == 12
    assert_all_free(scheduler)


def test_tokens_after_a_stop_are_dropped_and_logprobs_forwarded() -> None:
    scheduler = create_scheduler()
    (a,) = create_requests(1, num_tokens=4)
    scheduler.add_request(a)
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out, {"0": [5, EOS_TOKEN_ID, 6]}, logprobs=True)
    (output,) = scheduler.update(out, runner_output)
    assert output.new_token_ids == [5, EOS_TOKEN_ID] and output.finish_reason == "stop"
    assert output.new_logprobs is not None
    assert [lp.token_ids for lp in output.new_logprobs] == [[5], [EOS_TOKEN_ID]]
    assert a.output_token_ids == [5, EOS_TOKEN_ID]
    assert_all_free(scheduler)


# --- abort ------------------------------------------------------------------------------------


def test_abort_in_every_state() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=9)
    prefilling, running, waiting = create_requests(3, num_tokens=[12, 4, 12])
    for request in (running, prefilling, waiting):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    # "1" decodes next; "0" is mid-prefill (5 of 12); "2" waits.
    assert out.num_scheduled_tokens == {"1": 4, "0": 5}
    assert scheduler.kv_cache_manager.num_free_blocks == 10 - 1 - 2

    assert scheduler.abort_requests(["0", "nope"]) == [prefilling]
    assert prefilling.status == RequestStatus.FINISHED_ABORTED
    assert prefilling.finish_reason == "abort"
    assert scheduler.kv_cache_manager.num_free_blocks == 9
    assert scheduler.abort_requests(["2", "0"]) == [waiting]
    assert scheduler.get_num_unfinished_requests() == 1
    out, _ = step(scheduler)
    # Only the one the runner held is reported.
    assert out.finished_req_ids == {"0"} and out.num_scheduled_tokens == {"1": 1}
    assert scheduler.abort_requests(["1"]) == [running]
    assert scheduler.kv_cache_manager.num_free_blocks == 10
    assert scheduler.schedule().finished_req_ids == {"1"}
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_abort_a_preempted_request() -> None:
    scheduler = create_scheduler()
    a, b = create_requests(2, num_tokens=[16, 24])
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"1"}
    assert scheduler.abort_requests(["1"]) == [b]
    # The runner dropped it from its batch at the preemption, but still holds its seeded
    # generator, so it is told the request finished.
    assert scheduler.schedule().finished_req_ids == {"1"}
    assert ids(scheduler.waiting) == []
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update() -> None:
    scheduler = create_scheduler()
    a, b = create_requests(2, num_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out)
    scheduler.abort_requests(["0"])
    core_outputs = scheduler.update(out, runner_output)
    assert [o.request_id for o in core_outputs] == ["1"] and a.output_token_ids == []
    assert scheduler.schedule().finished_req_ids == {"0"}
    assert_all_free(scheduler)


# --- stats and a mixed workload ---------------------------------------------------------------


def test_make_stats() -> None:
    scheduler = create_scheduler()
    a, b = create_requests(2, num_tokens=28)
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_free_blocks, stats.num_blocks) == (3, 10)
    assert stats.kv_cache_usage == pytest.approx(0.7)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (28, 0)
    assert stats.num_preemptions == 0
    assert_all_free(scheduler)


def test_mixed_workload_keeps_every_invariant() -> None:
    """Seeded random prompts sharing prefixes, a tight pool and budget, random stops: after
    every step the budget, max_num_seqs and block accounting hold, and all requests end."""
    rng = random.Random(0)
    scheduler = create_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=10)
    prefixes = [[rng.randrange(10, 20) for _ in range(8)] for _ in range(3)]
    for i in range(12):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 9)] + [rng.randrange(10, 99)] * (i % 5)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
    finished: set[str] = set()
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 10
        assert len(scheduler.running) <= 4
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
        tokens = {r: [rng.choice([EOS_TOKEN_ID, 30, 31, 32])] for r in out.num_scheduled_tokens}
        for core_output in scheduler.update(out, fake_runner_output(scheduler, out, tokens)):
            if core_output.finish_reason is not None:
                finished.add(core_output.request_id)
        scheduler.check_integrity()
    assert finished == {f"r{i}" for i in range(12)}
    assert scheduler.make_stats().prefix_cache_hits > 0
    assert_all_free(scheduler)


def test_long_prefill_threshold_caps_prompt_chunks_beside_decoding_streams() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    a, b, c = create_requests(3, num_tokens=[10, 3, 9])
    scheduler.add_request(a)
    scheduler.add_request(b)
    # No stream is decoding: the prompts run whole, within the budget.
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 10, "1": 3}
    # Now both decode: a prompt that arrives gets at most 4 tokens a step beside them.
    scheduler.add_request(c)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 4}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 4}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 1}
    assert_all_free(scheduler)


def test_long_prefill_threshold_must_not_be_negative() -> None:
    from octavo.config import EngineArgs, SchedulerConfig

    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0, got -1"):
        EngineArgs(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0, got -1"):
        SchedulerConfig(4, 64, 64, long_prefill_token_threshold=-1)


def test_update_ignores_prefill_chunks_without_tokens() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=4)
    (a,) = create_requests(1, num_tokens=10)
    scheduler.add_request(a)
    out = scheduler.schedule()
    assert scheduler.update(out, ModelRunnerOutput(["0"], [[]], [None])) == []
    assert a.output_token_ids == [] and a.num_computed_tokens == 4
    assert_all_free(scheduler)
