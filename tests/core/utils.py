"""Helpers for scheduler and KV cache tests: a tiny pool, hand-made requests, a fake runner."""

from __future__ import annotations

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.admission import AdmissionPolicy
from octavo.core.block_hash import extend_block_hashes
from octavo.core.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from octavo.core.request import Request, ResolvedParams
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput

EOS_TOKEN_ID = 2


def create_scheduler(
    num_blocks: int = 10,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    policy: AdmissionPolicy | None = None,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy,
        ),
        CacheConfig(block_size, num_blocks, enable_prefix_caching),
        policy,
    )


def ids(requests) -> list[str]:
    """The request ids of a queue or list, in order."""
    return [request.request_id for request in requests]


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 16,
    eos_token_id: int | None = EOS_TOKEN_ID,
    block_size: int | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    """A request as the engine would hand it over: EOS already among the stop ids.

    With `block_size`, its block hashes are filled (for tests of the manager alone; the
    scheduler fills them itself in add_request).
    """
    sampling_params = SamplingParams(max_tokens=max_tokens, **params)
    stop_ids = set(sampling_params.stop_token_ids)
    if eos_token_id is not None:
        stop_ids.add(eos_token_id)
    resolved = ResolvedParams(max_tokens, frozenset(stop_ids))
    request = Request(
        request_id,
        prompt_token_ids,
        sampling_params,
        resolved,
        arrival_time=arrival_time,
        priority=priority,
    )
    if block_size is not None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, block_size)
    return request


def create_requests(
    num_requests: int,
    num_tokens: int | list[int] = 10,
    max_tokens: int = 16,
    same_prompt: bool = False,
    **params: object,
) -> list[Request]:
    """Requests "0", "1", ... with distinct prompts (request i uses ids 1000*(i+1) + t), or
    all with the prompt 100, 101, ... when `same_prompt`. `num_tokens` is one prompt length
    for all or one per request."""
    lengths = [num_tokens] * num_requests if isinstance(num_tokens, int) else num_tokens
    assert len(lengths) == num_requests
    requests = []
    for i, length in enumerate(lengths):
        base = 100 if same_prompt else 1000 * (i + 1)
        prompt = [base + t for t in range(length)]
        requests.append(make_request(str(i), prompt, max_tokens, **params))
    return requests


def fake_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sampled: dict[str, list[int]] | int = 7,
    logprobs: bool = False,
) -> ModelRunnerOutput:
    """What a runner would return: a token for every scheduled request whose known tokens are
    all computed after this step (a non-final prefill chunk samples nothing). `sampled` is one
    token for all, or per request id the token list to return."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled_token_ids: list[list[int]] = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled_token_ids.append([])
        elif isinstance(sampled, int):
            sampled_token_ids.append([sampled])
        else:
            sampled_token_ids.append(list(sampled.get(request_id, [7])))
    all_logprobs: list[list[TokenLogprobs] | None] = [
        [TokenLogprobs([t], [-0.5], 1) for t in tokens] if logprobs and tokens else None
        for tokens in sampled_token_ids
    ]
    return ModelRunnerOutput(req_ids, sampled_token_ids, all_logprobs)


def step(
    scheduler: Scheduler, sampled: dict[str, list[int]] | int = 7
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One schedule -> fake runner -> update round."""
    scheduler_output = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, scheduler_output, sampled)
    return scheduler_output, scheduler.update(scheduler_output, runner_output)


def free_queue_ids(scheduler: Scheduler) -> list[int]:
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    return [block.block_id for block in queue.get_all_free_blocks()]


def ref_cnts(scheduler: Scheduler, block_ids: list[int]) -> list[int]:
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    return [blocks[block_id].ref_cnt for block_id in block_ids]


def assert_all_free(scheduler: Scheduler) -> None:
    """Abort whatever is left, flush the finished ids, and check that no block leaked."""
    scheduler.abort_requests(list(scheduler.requests))
    scheduler.schedule()
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.usage == 0.0
