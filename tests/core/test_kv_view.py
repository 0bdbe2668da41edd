"""kv_snapshot (GET /v1/kv's engine part) on 10 blocks of 4 tokens: exact pool counts, blocks
held and shared per request, states, preemptions and cached blocks evicted."""

from __future__ import annotations

from octavo.core.kv_view import kv_snapshot

from .utils import assert_all_free, create_requests, create_scheduler, make_request, step


def _rows(snapshot: dict) -> list[tuple]:
    return [
        (
            r["request_id"],
            r["state"],
            r["num_computed_tokens"],
            r["num_output_tokens"],
            r["num_blocks"],
            r["num_shared_blocks"],
            r["num_cached_tokens"],
            r["num_preemptions"],
        )
        for r in snapshot["requests"]
    ]


def test_siblings_share_their_prompt_blocks_and_a_waiting_request_holds_none() -> None:
    scheduler = create_scheduler()
    for request in create_requests(3, num_tokens=10, same_prompt=True):
        scheduler.add_request(request)
    step(scheduler)
    # Blocks 0 and 1 (the full blocks of the prompt) are held by all three; each has its own
    # third block. 30 tokens need 8 blocks: 5 are free, so it waits.
    scheduler.add_request(make_request("w", list(range(500, 530))))
    step(scheduler)
    snapshot = kv_snapshot(scheduler)
    assert {k: v for k, v in snapshot.items() if k != "requests"} == {
        "block_size": 4,
        "num_blocks": 10,
        "num_free_blocks": 5,
        "num_cached_blocks": 2,
        "usage": 0.5,
        "num_running_reqs": 3,
        "num_waiting_reqs": 1,
        "num_preemptions": 0,
        "num_evicted_cached_blocks": 0,
        "prefix_cache_queries": 30,
        "prefix_cache_hits": 16,
    }
    assert _rows(snapshot) == [
        ("0", "running", 11, 2, 3, 2, 0, 0),
        ("1", "running", 11, 2, 3, 2, 8, 0),
        ("2", "running", 11, 2, 3, 2, 8, 0),
        ("w", "waiting", 0, 0, 0, 0, 0, 0),
    ]
    assert snapshot["requests"][3]["num_prompt_tokens"] == 30
    assert_all_free(scheduler)


def test_a_preempted_request_and_an_evicted_cached_block_are_counted() -> None:
    scheduler = create_scheduler()
    a, b, c = create_requests(3, num_tokens=[16, 12, 8])
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    step(scheduler)  # b needs a block: c, the newest, is preempted
    snapshot = kv_snapshot(scheduler)
    assert snapshot["num_preemptions"] == 1
    assert _rows(snapshot) == [
        ("0", "running", 17, 2, 5, 0, 0, 0),
        ("1", "running", 13, 2, 4, 0, 0, 0),
        ("2", "preempted", 0, 1, 0, 0, 0, 1),
    ]
    # c's freed blocks kept their prefix, tail first in the free queue: b took the tail (block
    # 8) for its own data, evicting it; block 7 is left, still cached.
    assert snapshot["num_evicted_cached_blocks"] == 1
    assert (snapshot["num_free_blocks"], snapshot["num_cached_blocks"]) == (1, 8)
    scheduler.abort_requests(["2"])
    scheduler.add_request(make_request("d", [1, 2, 3]))
    step(scheduler)
    assert kv_snapshot(scheduler)["num_evicted_cached_blocks"] == 2
    assert_all_free(scheduler)
