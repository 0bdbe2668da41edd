"""Pooling requests in the scheduler, without a model: prompt-only, chunked like any prompt,
ended (STOPPED, with the runner's vector) in the step that computes the last prompt token,
blocks back in the pool; prefix hits only where the request's pooling allows them; an
encoder's prompts whole or not at all."""

from __future__ import annotations

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import FinishReason, Request, ResolvedParams
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler import Scheduler

from .utils import create_scheduler


def _pooling_request(request_id: str, prompt: list[int], skip_cache: bool = False) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1),
        ResolvedParams(max_tokens=0, stop_token_ids=frozenset()),
        pooling_params=PoolingParams(task="embed", skip_reading_prefix_cache=skip_cache),
    )


def _run_step(scheduler: Scheduler, vectors: dict[str, list[float]]):
    """One step whose runner pools `vectors` for the requests that finish their prompt."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    pooled = {
        request_id: vectors[request_id]
        for request_id in req_ids
        if scheduler.requests[request_id].num_computed_tokens
        >= scheduler.requests[request_id].num_prompt_tokens
    }
    runner_output = ModelRunnerOutput(
        req_ids, [[] for _ in req_ids], [None] * len(req_ids), pooled=pooled
    )
    return output, scheduler.update(output, runner_output)


def test_chunked_pooling_request_ends_with_its_vector_and_frees_its_blocks() -> None:
    scheduler = create_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=6)
    scheduler.add_request(_pooling_request("a", list(range(10, 23))))  # 13 tokens
    chunks, finished = [], []
    while scheduler.has_unfinished_requests():
        output, outputs = _run_step(scheduler, {"a": [0.5, -0.5]})
        chunks.append(output.num_scheduled_tokens["a"])
        assert output.scheduled_new_reqs == [] or output.scheduled_new_reqs[0].pooling_params
        finished.extend(outputs)
    assert chunks == [6, 6, 1]
    (final,) = finished
    assert final.finish_reason == FinishReason.STOP
    assert final.pooled == [0.5, -0.5] and final.new_token_ids == []
    scheduler.check_integrity()
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_hits_only_where_the_pooling_allows() -> None:
    scheduler = create_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    scheduler.add_request(_pooling_request("first", prompt))
    _run_step(scheduler, {"first": [1.0]})
    scheduler.add_request(_pooling_request("last", prompt))
    output, _ = _run_step(scheduler, {"last": [1.0]})
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12  # LAST: hits taken
    scheduler.add_request(_pooling_request("mean", prompt, skip_cache=True))
    output, _ = _run_step(scheduler, {"mean": [1.0]})
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0  # MEAN / CLS: none
    assert output.num_scheduled_tokens["mean"] == 13
    scheduler.check_integrity()


def test_encoder_prompts_run_whole_or_wait() -> None:
    scheduler = Scheduler(
        SchedulerConfig(16, 8, 8, enable_chunked_prefill=False),
        CacheConfig(4, 10, enable_prefix_caching=False),
    )
    for request_id, length in (("a", 5), ("b", 5), ("c", 3)):
        scheduler.add_request(_pooling_request(request_id, list(range(length))))
    steps = []
    while scheduler.has_unfinished_requests():
        output, _ = _run_step(scheduler, {"a": [1.0], "b": [2.0], "c": [3.0]})
        steps.append(dict(output.num_scheduled_tokens))
    # b does not fit beside a (5 + 5 > 8) and is never split; c waits behind it (FCFS).
    assert steps == [{"a": 5}, {"b": 5, "c": 3}]
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
