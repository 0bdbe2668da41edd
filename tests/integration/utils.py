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
