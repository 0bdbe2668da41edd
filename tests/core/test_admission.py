"""Admission policies through the real scheduler, on 10 blocks of 4 tokens: what each policy
admits, whom it evicts and in which order, that `reserve` never evicts, and how the `ratio`
policy's estimate decays and resets.

Every test ends with assert_all_free: all requests finished or aborted, no block leaked.
"""

from __future__ import annotations

import random

import pytest

from octavo.config import SchedulerConfig
from octavo.core.admission import (
    CurrentPolicy,
    RatioPolicy,
    ReservePolicy,
    least_output_victim,
    make_admission_policy,
    newest_victim,
    priority_victim,
)
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput

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


def with_output(request: Request, num_output_tokens: int) -> Request:
    request.append_output_token_ids([7] * num_output_tokens)
    return request


def run_until_preempted(scheduler: Scheduler, max_steps: int = 50) -> tuple[int, SchedulerOutput]:
    """Step (every request samples token 7) until a step preempts; its 1-based number."""
    for step_idx in range(1, max_steps + 1):
        out, _ = step(scheduler)
        if out.preempted_req_ids:
            return step_idx, out
    raise AssertionError("no preemption")


# --- victim rules and construction ------------------------------------------------------------


def test_victim_rules() -> None:
    a = with_output(make_request("a", [1] * 4), 5)
    b = with_output(make_request("b", [1] * 4), 2)
    c = with_output(make_request("c", [1] * 8), 2)
    d = with_output(make_request("d", [1] * 8), 2)
    assert newest_victim([a, b, c, d]) is d
    # Least output (2); among those the longest prompt (8); among those the newest.
    assert least_output_victim([a, b, c, d]) is d
    assert least_output_victim([a, b, c]) is c
    assert least_output_victim([a, b]) is b
    assert least_output_victim([a]) is a


def test_make_admission_policy_from_config() -> None:
    def make(**kwargs):
        return make_admission_policy(SchedulerConfig(4, 64, 64, **kwargs))

    current = make()
    assert type(current) is CurrentPolicy and current.watermark == 0.0
    assert current.victim is newest_victim
    ratio = make(admission="ratio", watermark=0.25)
    assert type(ratio) is RatioPolicy and ratio.watermark == 0.25
    assert ratio.victim is least_output_victim and ratio.ratio == 0.7
    assert ratio.decay == pytest.approx(0.001)
    assert type(make(admission="reserve")) is ReservePolicy
    assert make(preempt_victim="least-output").victim is least_output_victim
    assert make(admission="ratio", preempt_victim="newest").victim is newest_victim
    with pytest.raises(ValueError, match="admission must be one of"):
        make(admission="tgi")
    with pytest.raises(ValueError, match="preempt_victim"):
        make(preempt_victim="oldest")
    with pytest.raises(ValueError, match="watermark"):
        make(watermark=1.0)
    with pytest.raises(ValueError, match="min_ratio"):
        RatioPolicy(init_ratio=0.05)


def test_the_priority_policy_gives_every_admission_policy_its_victim_rule() -> None:
    """Under --scheduling-policy priority each admission policy keeps its admission rule and
    evicts by priority (vLLM's: the largest (priority, arrival time)); --preempt-victim would
    be a second rule for the same choice and is refused."""
    for admission in ("current", "reserve", "ratio"):
        config = SchedulerConfig(4, 64, 64, admission=admission, scheduling_policy="priority")
        policy = make_admission_policy(config)
        assert policy.victim is priority_victim
    early_low = make_request("early-low", [1], priority=2, arrival_time=0.0)
    late_low = make_request("late-low", [1], priority=2, arrival_time=3.0)
    high = make_request("high", [1], priority=-1, arrival_time=5.0)
    assert priority_victim([early_low, high, late_low]) is late_low
    assert priority_victim([high, early_low]) is early_low
    with pytest.raises(ValueError, match="cannot be combined with scheduling_policy"):
        SchedulerConfig(4, 64, 64, scheduling_policy="priority", preempt_victim="newest")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(4, 64, 64, scheduling_policy="lifo")


# --- what is admitted -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,admitted",
    [
        (CurrentPolicy(), ["0", "1", "2", "3"]),
        (RatioPolicy(), ["0", "1", "2"]),
        (ReservePolicy(), ["0", "1"]),
        (RatioPolicy(watermark=0.1), ["0", "1"]),
        (ReservePolicy(watermark=0.35), ["0"]),
    ],
    ids=["current", "ratio", "reserve", "ratio-watermark", "reserve-watermark"],
)
def test_policies_admit_differently_from_one_queue(policy, admitted) -> None:
    """20 blocks; four prompts of 4 tokens (1 block) with max_tokens 24. The first always
    starts (empty batch); a candidate must fit its prompt + whole answer, 7 blocks.
    reserve: a running request grows to ceil(28 / 4) = 7 blocks, 6 more than it holds:
      "1": 19 - 6 >= 7; "2": 18 - 12 < 7.
    ratio 0.7: a running request reserves ceil(24 * 0.7) = 17 answer tokens, 6 blocks in
      all, 5 more: "1": 19 - 5 >= 7; "2": 18 - 10 >= 7; "3": 17 - 15 < 7.
    current: each prompt's one block is free.
    A watermark keeps int(share * 20) blocks out: ratio with 2, "2": 18 - 10 - 2 < 7; reserve
    with 7, "1": 19 - 6 - 7 < 7.
    """
    scheduler = create_scheduler(num_blocks=20, policy=policy)
    for request in create_requests(4, num_tokens=4, max_tokens=24):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert [n.request_id for n in out.scheduled_new_reqs] == admitted
    assert_all_free(scheduler)


def test_reserve_counts_shared_prefix_blocks_once() -> None:
    """5 blocks. "a" and "b" share an 8-token prompt, max_tokens 4: each ends at 12 tokens,
    3 blocks. "a" starts (2 blocks held, grows by 1); "b" hits a's block 0, held, so it needs
    3 - 1 = 2 blocks, and 3 free - 1 reserved for "a" leaves exactly 2. With a prompt of its
    own it would need 3 and wait."""
    scheduler = create_scheduler(num_blocks=5, policy=ReservePolicy())
    prompt = list(range(10, 18))
    scheduler.add_request(make_request("a", prompt, max_tokens=4))
    scheduler.add_request(make_request("b", prompt, max_tokens=4))
    scheduler.add_request(make_request("c", list(range(50, 58)), max_tokens=4))
    out, _ = step(scheduler)
    assert [(n.request_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("a", [0, 1], 0),
        ("b", [0, 2], 4),
    ]
    assert ids(scheduler.waiting) == ["c"]
    for _ in range(3):
        out, _ = step(scheduler)
        assert out.preempted_req_ids == set() and out.scheduled_new_reqs == []
    # a and b finished on their 4th token; c starts once they are gone.
    assert not scheduler.running
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["c"]
    assert_all_free(scheduler)

    scheduler = create_scheduler(num_blocks=5, policy=ReservePolicy())
    scheduler.add_request(make_request("a", prompt, max_tokens=4))
    scheduler.add_request(make_request("b", list(range(30, 38)), max_tokens=4))
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["a"] and ids(scheduler.waiting) == ["b"]
    assert_all_free(scheduler)


@pytest.mark.parametrize("max_tokens,admitted", [(4, True), (8, False)])
def test_reserve_charges_hits_on_free_cached_blocks(max_tokens: int, admitted: bool) -> None:
    """5 blocks. "x" leaves its 8-token prompt cached in free blocks 0 and 1. "d" (4 + 4
    tokens) starts and will grow by 1 block. "c" repeats x's prompt: it hits block 0, which
    leaves the free queue, so with max_tokens 8 it needs 16 / 4 - 1 hit + 1 free hit = 4
    blocks of the 4 - 1 available; with max_tokens 4 it needs 3."""
    scheduler = create_scheduler(num_blocks=5, policy=ReservePolicy())
    prompt = list(range(10, 18))
    scheduler.add_request(make_request("x", prompt, max_tokens=1))
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 5
    scheduler.add_request(make_request("d", [50, 51, 52, 53], max_tokens=4))
    scheduler.add_request(make_request("c", prompt, max_tokens=max_tokens))
    out, _ = step(scheduler)
    expected = ["d", "c"] if admitted else ["d"]
    assert ids(out.scheduled_new_reqs) == expected
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler)
        assert out.preempted_req_ids == set()
    assert_all_free(scheduler)


def _run_mixed_workload(scheduler: Scheduler, seed: int) -> tuple[int, set[str]]:
    """Seeded prompts sharing prefixes, random answer lengths, a tight pool: returns the
    number of preemptions and the ids that finished. Checks integrity after every step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 20) for _ in range(8)] for _ in range(3)]
    for i in range(16):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 9)] + [rng.randrange(10, 99)] * (i % 5)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(4, 24)))
    num_preemptions = 0
    finished: set[str] = set()
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        num_preemptions += len(out.preempted_req_ids)
        # EOS one time in eight: most answers end well before max_tokens.
        tokens = {
            r: [EOS_TOKEN_ID if rng.random() < 0.125 else 30] for r in out.num_scheduled_tokens
        }
        for core_output in scheduler.update(out, fake_runner_output(scheduler, out, tokens)):
            if core_output.finish_reason is not None:
                finished.add(core_output.request_id)
        scheduler.check_integrity()
    return num_preemptions, finished


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reserve_never_evicts_where_current_does(seed: int) -> None:
    everyone = {f"r{i}" for i in range(16)}
    results = {}
    for name, policy in (
        ("current", CurrentPolicy()),
        ("reserve", ReservePolicy()),
        ("ratio", RatioPolicy()),
    ):
        scheduler = create_scheduler(
            num_blocks=12, max_num_seqs=8, max_num_batched_tokens=16, policy=policy
        )
        results[name] = _run_mixed_workload(scheduler, seed)
        assert results[name][1] == everyone, name
        assert_all_free(scheduler)
    assert results["reserve"][0] == 0
    assert results["current"][0] > 0


# --- the ratio: decay and reset ---------------------------------------------------------------


def test_ratio_decays_each_step_that_runs_without_eviction() -> None:
    policy = RatioPolicy(init_ratio=0.7, min_ratio=0.1, decay_steps=3)
    scheduler = create_scheduler(policy=policy)
    scheduler.schedule()  # nothing runs: no decay
    assert policy.ratio == 0.7
    scheduler.add_request(make_request("a", [1, 2, 3, 4], max_tokens=10))
    ratios = []
    for _ in range(5):
        step(scheduler)
        ratios.append(policy.ratio)
    assert ratios == pytest.approx([0.5, 0.3, 0.1, 0.1, 0.1])
    assert_all_free(scheduler)


def test_ratio_reset_from_usage() -> None:
    policy = RatioPolicy()
    r1 = with_output(make_request("1", [1] * 4, max_tokens=16), 3)
    r2 = with_output(make_request("2", [1] * 4, max_tokens=5000), 1000)
    # (3 + 20 + 1000 + 20) / (16 + min(5000, 4096))
    policy.observe_step([r1, r2], num_preempted=1)
    assert policy.ratio == pytest.approx(1043 / 4112)
    # Kept within [min_ratio, 1]: 20 / 4096 is raised to 0.1, 29 / 10 lowered to 1.
    policy.observe_step([make_request("3", [1], max_tokens=4096)], num_preempted=1)
    assert policy.ratio == pytest.approx(0.1)
    policy.observe_step([with_output(make_request("4", [1], max_tokens=10), 9)], num_preempted=2)
    assert policy.ratio == 1.0
    # Nobody left running: back to the initial estimate.
    policy.observe_step([], num_preempted=1)
    assert policy.ratio == 0.7
    # A step without eviction decays it by (0.7 - 0.1) / 600.
    policy.observe_step([r1], num_preempted=0)
    assert policy.ratio == pytest.approx(0.699)


def test_ratio_evicts_the_least_output_resets_and_admits_nothing_that_step() -> None:
    """10 blocks; "0", "1", "2": 4-token prompts, max_tokens 12, never EOS. The ratio drops
    to its floor after one step (decay_steps=1), which lets "2" in at step 2. Each grows to 4
    blocks, 12 > 10: at step 10 "1" finds no block for position 12 and "2" (8 outputs, the
    others 9) is evicted. The ratio is reset to (9 + 2 + 9 + 2) / (12 + 12); "d", waiting,
    is not admitted in that step."""
    policy = RatioPolicy(decay_steps=1, reset_headroom_tokens=2)
    scheduler = create_scheduler(policy=policy)
    for request in create_requests(3, num_tokens=4, max_tokens=12):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["0", "1"] and policy.ratio == pytest.approx(0.1)
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["2"]
    for _ in range(7):
        out, _ = step(scheduler)
        assert out.preempted_req_ids == set()
    scheduler.add_request(make_request("d", [60, 61, 62, 63], max_tokens=4))
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"2"} and out.scheduled_new_reqs == []
    assert out.num_scheduled_tokens == {"0": 1, "1": 1}
    assert policy.ratio == pytest.approx(22 / 24)
    assert ids(scheduler.waiting) == ["2", "d"]
    # "2" resumes (from its cached first 8 tokens) once "0" and "1" have finished.
    while scheduler.running:
        out, _ = step(scheduler)
        assert out.preempted_req_ids == set()
    out, _ = step(scheduler)
    assert ids(out.scheduled_new_reqs) == ["2", "d"]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert_all_free(scheduler)


@pytest.mark.parametrize(
    "victim,preempted,scheduled",
    [(newest_victim, "1", {"0": 1}), (least_output_victim, "0", {"1": 1})],
    ids=["newest", "least-output"],
)
def test_victim_override_on_equal_outputs(victim, preempted, scheduled) -> None:
    """10 blocks; "0" (12-token prompt) and "1" (4 tokens) decode side by side. At step 14
    "0" needs a 7th block and none is free; both have 13 outputs. newest evicts "1";
    least-output breaks the tie by the longer prompt and "0" evicts itself."""
    scheduler = create_scheduler(policy=CurrentPolicy(victim=victim))
    requests = create_requests(2, num_tokens=[12, 4], max_tokens=30)
    for request in requests:
        scheduler.add_request(request)
    step_idx, out = run_until_preempted(scheduler)
    assert step_idx == 14
    assert out.preempted_req_ids == {preempted} and out.num_scheduled_tokens == scheduled
    # 13 outputs each when the victim was chosen; the survivor got its 14th in that step.
    survivor = next(iter(scheduled))
    assert {r.request_id: r.num_output_tokens for r in requests} == {preempted: 13, survivor: 14}
    assert_all_free(scheduler)
