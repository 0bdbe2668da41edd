"""The `forecast` admission policy: its length model, its peak forecast, what it admits
before and after it has learned answer lengths, whom it evicts, and its promise that an
evicted request is back before any new request starts.

Every scheduler test ends with assert_all_free: all requests finished, no block leaked.
"""

from __future__ import annotations

import random

import pytest

from octavo.core.admission import (
    AnswerLengths,
    CurrentPolicy,
    ForecastPolicy,
    _forecast_peak_blocks,
    least_harm_victim,
)
from octavo.core.request import RequestStatus
from octavo.core.scheduler import Scheduler

from .utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    create_requests,
    create_scheduler,
    fake_runner_output,
    ids,
    make_request,
    step,
)


def test_answer_lengths_keep_a_window_and_answer_conditional_quantiles() -> None:
    lengths = AnswerLengths(window=3)
    for n in (10, 40, 20, 30):
        lengths.add(n)
    assert len(lengths) == 3  # 10, the oldest, has left the window
    # Longer than 15: 20, 30, 40; the median of them is 30, 15 more than 15.
    assert lengths.remaining(15, 0.5) == 15
    assert lengths.remaining(15, 1.0) == 25
    assert lengths.remaining(0, 0.1) == 20
    assert lengths.remaining(40, 0.5) is None  # nobody went further
    with pytest.raises(ValueError, match="window"):
        AnswerLengths(0)


def test_the_peak_is_just_before_a_request_ends() -> None:
    """Blocks of 4. "a": 8 tokens in 2 blocks, 8 to go; "b": 4 tokens in 1 block, 4 to go.
    At T=4 both are alive: a has taken 12/4 - 2 = 1 block, b 8/4 - 1 = 1: 2. At T=8 only a
    is: 16/4 - 2 = 2, less the block b gave back: 1. The peak is 2."""
    assert _forecast_peak_blocks([(8, 2, 8), (4, 1, 4)], 4) == 2
    # A request that ends now gives its block back to the one that grows to 2 blocks.
    assert _forecast_peak_blocks([(0, 1, 4), (8, 0, 0)], 4) == 1
    assert _forecast_peak_blocks([], 4) == 0


def test_cold_start_reserves_a_share_of_max_tokens_then_learns() -> None:
    """20 blocks of 4; prompts of 4 tokens (1 block), max_tokens 24. Cold (fewer than
    min_samples=2 ended), every answer is taken as ceil(24 x 0.5) = 12 tokens: each running
    request will take (4 + 12) / 4 - 1 = 3 more blocks and a candidate 4, so with k running
    the candidate needs 3k + 4 <= 20 - k: "0".."4" start, "5" waits.
    Once two answers have ended after 2 tokens, the prediction at 0 output tokens is 2:
    a running request takes 0.5 more blocks and a candidate 1.5, and all of the 8 new ones
    start at once."""
    policy = ForecastPolicy(min_samples=2, cold_ratio=0.5)
    scheduler = create_scheduler(num_blocks=20, policy=policy)
    for request in create_requests(6, num_tokens=4, max_tokens=24):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["0", "1", "2", "3", "4"]
    scheduler.abort_requests(list(scheduler.requests))
    step(scheduler)  # an abort ends a request as well: 5 answers of 1 token learned
    assert len(policy.lengths) == 5
    assert_all_free(scheduler)

    policy = ForecastPolicy(min_samples=2, cold_ratio=0.5)
    scheduler = create_scheduler(num_blocks=20, policy=policy)
    for request in create_requests(2, num_tokens=4, max_tokens=24):
        scheduler.add_request(request)
    step(scheduler)
    step(scheduler, {"0": [EOS_TOKEN_ID], "1": [EOS_TOKEN_ID]})
    step(scheduler)  # the step that observes they ended
    assert (
        len(policy.lengths) == 2
        and policy.predicted_remaining(make_request("x", [1], max_tokens=24)) == 2
    )
    for i in range(8):
        scheduler.add_request(make_request(f"n{i}", [500 + 4 * i + t for t in range(4)], 24))
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == [f"n{i}" for i in range(8)]
    scheduler.abort_requests(list(scheduler.requests))
    assert_all_free(scheduler)


def test_a_request_longer_than_every_ended_one_is_expected_to_double() -> None:
    policy = ForecastPolicy(min_samples=1)
    policy.lengths.add(5)
    request = make_request("a", [1, 2], max_tokens=100)
    request.append_output_token_ids([7] * 30)
    assert policy.predicted_remaining(request) == 30
    request.append_output_token_ids([7] * 50)
    assert policy.predicted_remaining(request) == 20  # capped by max_tokens


def test_least_harm_victim() -> None:
    a, b, c = (
        make_request(name, [1] * n, max_tokens=50) for name, n in (("a", 4), ("b", 9), ("c", 2))
    )
    for request, num_output in ((a, 3), (b, 0), (c, 5)):
        request.append_output_token_ids([7] * num_output)
    # b has streamed nothing: evicting it delays a first token, it freezes no stream.
    assert least_harm_victim([a, b, c]) is b
    # Else the fewest tokens to recompute: a (7) over c (7): the newest among equals, c.
    assert least_harm_victim([a, c]) is c
    b.append_output_token_ids([7])
    assert least_harm_victim([a, b, c]) is c


def _run_random_workload(scheduler: Scheduler, seed: int) -> tuple[int, set[str]]:
    """16 requests with seeded prompts sharing prefixes, random max_tokens, EOS one time in
    eight, on a tight pool. Checks integrity after every step and the forecast's promise:
    no request starts for the first time while an evicted one is still waiting."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 20) for _ in range(8)] for _ in range(3)]
    for i in range(16):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 9)] + [rng.randrange(10, 99)] * (i % 5)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(4, 24)))
    num_preemptions = 0
    finished: set[str] = set()
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        started = [scheduler.requests[r.request_id] for r in out.scheduled_new_reqs]
        if any(r.num_preemptions == 0 for r in started):
            still_evicted = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
            assert not still_evicted, "a new request started before an evicted one"
        num_preemptions += len(out.preempted_req_ids)
        tokens = {
            r: [EOS_TOKEN_ID if rng.random() < 0.125 else 30] for r in out.num_scheduled_tokens
        }
        for core_output in scheduler.update(out, fake_runner_output(scheduler, out, tokens)):
            if core_output.finish_reason is not None:
                finished.add(core_output.request_id)
        scheduler.check_integrity()
    return num_preemptions, finished


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_without_leaks_and_evict_less(seed: int) -> None:
    everyone = {f"r{i}" for i in range(16)}
    preemptions = {}
    for name, policy in (("current", CurrentPolicy()), ("forecast", ForecastPolicy(min_samples=2))):
        scheduler = create_scheduler(
            num_blocks=12, max_num_seqs=8, max_num_batched_tokens=16, policy=policy
        )
        preemptions[name], finished = _run_random_workload(scheduler, seed)
        assert finished == everyone, name
        assert_all_free(scheduler)
    assert preemptions["forecast"] <= preemptions["current"]


@pytest.mark.parametrize("readmit_evicted", [True, False])
def test_an_evicted_request_is_readmitted_when_its_blocks_are_free(readmit_evicted) -> None:
    """20 blocks of 4, cold with cold_ratio 1: "0" (4 tokens, max_tokens 60) starts alone and
    is expected to take (4 + 60) / 4 - 1 = 15 more blocks; "1" would take 16 beside it, and
    15 + 16 > 19 free: it waits. Had "1" been evicted before, its wait is bounded by free
    blocks only, not by the forecast."""
    policy = ForecastPolicy(cold_ratio=1.0, readmit_evicted=readmit_evicted)
    scheduler = create_scheduler(num_blocks=20, max_model_len=128, policy=policy)
    for request in create_requests(2, num_tokens=4, max_tokens=60):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["0"]
    out, _ = step(scheduler)
    assert out.scheduled_new_reqs == []
    scheduler.requests["1"].num_preemptions = 1  # as if evicted earlier
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == (["1"] if readmit_evicted else [])
    scheduler.abort_requests(["0", "1"])
    assert_all_free(scheduler)
