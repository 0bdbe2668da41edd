"""Shared checks for engine tests."""

from __future__ import annotations

from octavo import LLM


def assert_no_leak(llm: LLM) -> None:
    """No request left anywhere, and every KV block back in the pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = engine.make_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    engine.scheduler.check_integrity()


def assert_greedy_agrees(expected, got, near_tie: float = 0.1) -> None:
    """Greedy outputs (generated with logprobs=2) of two runs that compute in different but
    equally valid orders: token for token the same, except that they may part where the
    expected run's two best tokens were within `near_tie` of each other in logprob and the
    other run took the second; nothing after a parting is comparable. Returns nothing; fails
    naming the request and position otherwise."""
    assert len(expected) == len(got)
    for index, (e, g) in enumerate(zip(expected, got)):
        e, g = e.outputs[0], g.outputs[0]
        for position, (a, b) in enumerate(zip(e.token_ids, g.token_ids)):
            if a == b:
                continue
            top = sorted(e.logprobs[position].items(), key=lambda item: -item[1].logprob)[:2]
            gap = top[0][1].logprob - top[1][1].logprob
            assert b == top[1][0] and gap < near_tie, (
                f"request {index} parts at token {position}: {b} where {a} was ahead by {gap}"
            )
            break
        else:
            assert list(e.token_ids) == list(g.token_ids), f"request {index}: lengths differ"
