"""StepRates and --max-queue-wait without a model: the measured rates from hand-made step stats,
the predicted time to first token by the documented formula, and QueueLimits shedding on it
(never before the rates are measured)."""

from __future__ import annotations

import pytest

from octavo.engine.queue_limits import QueueLimits, QueueOverflowError
from octavo.engine.step_rates import StepRates, StepShape
from octavo.metrics.stats import IterationStats, SchedulerStats


def _step(
    step_time_s: float, num_tokens: int, num_prompt_tokens: int, num_output: int = 0
) -> IterationStats:
    return IterationStats(
        num_scheduled_tokens=num_tokens,
        num_scheduled_prompt_tokens=num_prompt_tokens,
        step_time_s=step_time_s,
        num_generation_tokens=num_output,
    )


def test_the_rates_are_exponentially_weighted_averages_of_the_steps() -> None:
    rates = StepRates(StepShape(max_num_batched_tokens=64), weight=0.5)
    assert not rates.is_measured and rates.predict_ttft_s(0, 10) is None
    running = SchedulerStats(num_running_reqs=4)
    # A pure decode step: the fixed cost of a step.
    rates.record(running, _step(0.1, 4, 0, 4))
    assert rates.decode_step_s == pytest.approx(0.1)
    assert not rates.is_measured
    # A step with 40 prompt tokens beside 4 decodes: (0.5 - 0.1) / 40 per prompt token.
    rates.record(running, _step(0.5, 44, 40, 4))
    assert rates.prompt_token_s == pytest.approx(0.01)
    rates.record(running, _step(0.3, 44, 40, 4))  # (0.3 - 0.1) / 40 = 0.005
    assert rates.prompt_token_s == pytest.approx(0.0075)
    rates.record(running, _step(0.2, 4, 0, 4))
    assert rates.decode_step_s == pytest.approx(0.15)
    assert rates.tokens_per_s == pytest.approx((((40 + 440 / 5) / 2 + 440 / 3) / 2 + 20) / 2)
    # A snapshot that is no step (an abort's, a sleep's) changes no rate.
    rates.record(SchedulerStats(num_running_reqs=2), IterationStats())
    assert (rates.decode_step_s, rates.prompt_token_s) == (pytest.approx(0.15), 0.0075)
    assert rates.num_running_reqs == 2


def test_the_predicted_wait_counts_the_steps_and_the_prompt_tokens_ahead() -> None:
    rates = StepRates(StepShape(max_num_batched_tokens=64, long_prefill_token_threshold=16))
    rates.decode_step_s, rates.prompt_token_s = 0.1, 0.01
    # Nothing running: 100 + 20 tokens in ceil(120 / 64) = 2 steps.
    assert rates.predict_ttft_s(100, 20) == pytest.approx(2 * 0.1 + 120 * 0.01)
    # 24 decoding: 40 prompt tokens a step, 3 steps; the cap (16 a step) needs 2 for 20.
    rates.record(SchedulerStats(num_running_reqs=24), IterationStats())
    assert rates.predict_ttft_s(100, 20) == pytest.approx(3 * 0.1 + 1.2)
    # A long prompt alone: its chunks of 16 take 5 steps.
    assert rates.predict_ttft_s(0, 80) == pytest.approx(5 * 0.1 + 0.8)
    # Two replicas share the work ahead and the running requests.
    two = StepRates(StepShape(max_num_batched_tokens=64, num_replicas=2))
    two.decode_step_s, two.prompt_token_s = 0.1, 0.01
    two.record(SchedulerStats(num_running_reqs=12), IterationStats(), engine_index=0)
    two.record(SchedulerStats(num_running_reqs=12), IterationStats(), engine_index=1)
    assert two.predict_ttft_s(100, 20) == pytest.approx(2 * 0.1 + 70 * 0.01)


def test_max_queue_wait_sheds_over_the_prediction_with_the_wait_as_retry_after() -> None:
    rates = StepRates(StepShape(max_num_batched_tokens=64))
    rejected: list[str] = []
    limits = QueueLimits(max_queue_wait_s=0.5, step_rates=rates, on_reject=rejected.append)
    # Cold start: no rates, nothing shed however much is queued.
    limits.admit(1, 1000)
    assert limits.predict_ttft_s(10) is None
    limits.finished(1)
    limits.prefilled(1000)
    rates.decode_step_s, rates.prompt_token_s = 0.1, 0.01
    limits.admit(1, 30)  # 0.1 + 0.3
    with pytest.raises(QueueOverflowError, match="--max-queue-wait") as caught:
        limits.admit(1, 30)  # 0.1 + 0.6
    assert caught.value.reason == "max_queue_wait"
    assert caught.value.retry_after_s == 1
    with pytest.raises(QueueOverflowError) as caught:
        limits.check(1, 120)  # 3 steps: 0.3 + 1.5
    assert caught.value.retry_after_s == 2
    limits.admit(1, 10)  # a short one still fits: 0.1 + 0.4
    assert (limits.num_reqs, limits.num_prefill_tokens) == (2, 40)
    assert rejected == ["max_queue_wait", "max_queue_wait"]


def test_max_queue_wait_must_be_positive() -> None:
    from octavo.config import EngineArgs, SchedulerConfig

    with pytest.raises(ValueError, match="max_queue_wait must be > 0"):
        EngineArgs(max_queue_wait=0)
    with pytest.raises(ValueError, match="max_queue_wait_s must be > 0"):
        SchedulerConfig(8, 64, 64, max_queue_wait_s=-1.0)


def test_the_flag_reaches_the_scheduler_config() -> None:
    from octavo.entrypoints.cli import engine_args_from, make_parser, subparser

    ns = subparser(make_parser(), "serve").parse_args(["--max-queue-wait", "2.5"])
    assert engine_args_from(ns).max_queue_wait == 2.5
    assert subparser(make_parser(), "serve").parse_args([]).max_queue_wait is None
