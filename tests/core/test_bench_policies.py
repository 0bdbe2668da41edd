"""`octavo bench policies` on a small trace: every request ends with its traced answer under
each policy, `reserve` never evicts while `current` does, the replay is deterministic, and
the executor counts redone prefill work."""

from __future__ import annotations

import dataclasses
import json

from octavo.bench.policies import (
    CostModel,
    CostModelExecutor,
    TraceConfig,
    make_trace,
    run_policy,
)
from octavo.config import CacheConfig, SchedulerConfig
from octavo.entrypoints.cli import main

from .utils import EOS_TOKEN_ID, assert_all_free, create_scheduler, make_request


def test_policies_on_a_small_trace() -> None:
    trace = make_trace(TraceConfig(num_requests=20, max_tokens=1024, seed=0))
    assert len(trace) == 20 and trace == make_trace(TraceConfig(20, max_tokens=1024, seed=0))
    max_model_len = max(len(t.prompt_token_ids) + t.max_tokens for t in trace)
    cache = CacheConfig(block_size=16, num_blocks=256)  # 4096 tokens
    scheduler_config = SchedulerConfig(64, 2048, max_model_len)
    results = {
        policy: run_policy(trace, policy, cache, scheduler_config, CostModel())
        for policy in ("current", "reserve", "ratio", "forecast")
    }
    for result in results.values():
        assert result.num_output_tokens == sum(t.answer_len for t in trace)
        assert 0 < result.median_ttft_s <= result.p99_ttft_s < result.elapsed_s
    current, reserve = results["current"], results["reserve"]
    assert current.num_preemptions > 0 and current.evicted_share > 0
    assert current.median_freeze_s > 0 and current.p99_freeze_s >= current.median_freeze_s
    assert current.redone_prefill_share > 0
    assert (reserve.num_preemptions, reserve.evicted_share, reserve.median_freeze_s) == (0, 0, None)
    assert reserve.redone_prefill_share == 0
    # Reserving makes requests queue: slower first tokens, lower throughput on this trace.
    assert reserve.median_ttft_s > current.median_ttft_s
    assert reserve.output_tokens_per_s < current.output_tokens_per_s
    assert run_policy(trace, "current", cache, scheduler_config, CostModel()) == current


def test_executor_counts_prefill_decodes_and_redone_tokens() -> None:
    """3 blocks of 4 tokens, no prefix caching. a (8 prompt tokens, answer 5) and b (4, answer
    3) prefill together; at step 2 a needs a third block and b, the newest, is evicted. It
    resumes after a has finished and recomputes its 5 tokens, 4 of them computed before."""
    scheduler = create_scheduler(num_blocks=3, enable_prefix_caching=False)
    cost = CostModel(step_s=1.0, prefill_token_s=0.5, decode_s=0.25)
    executor = CostModelExecutor({"a": 5, "b": 3}, cost)
    scheduler.add_request(make_request("a", list(range(10, 18)), max_tokens=5))
    scheduler.add_request(make_request("b", [20, 21, 22, 23], max_tokens=5))
    step_times_s, preempted, outputs = [], [], {"a": [], "b": []}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        runner_output, step_s = executor.execute(out)
        step_times_s.append(step_s)
        preempted.append(sorted(out.preempted_req_ids))
        for core_output in scheduler.update(out, runner_output):
            outputs[core_output.request_id].extend(core_output.new_token_ids)
    assert step_times_s == [1.0 + 12 * 0.5, 1.25, 1.25, 1.25, 1.25, 1.0 + 5 * 0.5, 1.25]
    assert preempted == [[], ["b"], [], [], [], [], []]
    assert outputs == {"a": [500] * 4 + [EOS_TOKEN_ID], "b": [500] * 2 + [EOS_TOKEN_ID]}
    assert (executor.num_prefill_tokens, executor.num_redone_tokens) == (17, 4)
    assert_all_free(scheduler)


def test_cli_prints_a_row_per_policy_and_a_json_line(capsys) -> None:
    assert (
        main(
            [
                "bench",
                "policies",
                "--num-requests",
                "12",
                "--kv-cache-tokens",
                "4096",
                "--max-tokens",
                "1024",
                "--policies",
                "current",
                "reserve",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("config: ")
    assert [line.split()[0] for line in out[3:5]] == ["current", "reserve"]
    result = json.loads(out[-1])
    assert [p["policy"] for p in result["policies"]] == ["current", "reserve"]
    assert result["policies"][1]["num_preemptions"] == 0


def test_cli_trace_preset_seeds_and_the_comparison_with_current(capsys) -> None:
    argv = ["bench", "policies", "--trace", "chat", "--num-requests", "40", "--seeds", "3"]
    assert main([*argv, "--policies", "current", "forecast"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    config = json.loads(out[0].removeprefix("config: "))
    assert config["trace"] == "chat" and config["seeds"] == 3
    assert config["trace_config"]["max_tokens"] == 1024  # the preset's
    assert config["trace_config"]["num_requests"] == 40  # the override
    assert "3 seeds pooled" in out[1]
    assert out[5].split()[:2] == ["vs", "current"] and out[6].split()[0] == "forecast"
    medians = json.loads(out[-1])["policies"]
    # Each column is the median of the three runs.
    trace_config = TraceConfig(**{**config["trace_config"], "seed": 0})
    cache = CacheConfig(16, 1024)
    runs = []
    for seed in range(3):
        trace = make_trace(dataclasses.replace(trace_config, seed=seed))
        max_model_len = max(len(t.prompt_token_ids) + t.max_tokens for t in trace)
        runs.append(
            run_policy(
                trace, "current", cache, SchedulerConfig(64, 2048, max_model_len), CostModel()
            )
        )
    assert medians[0]["output_tokens_per_s"] == sorted(r.output_tokens_per_s for r in runs)[1]


def test_runs_over_seeds_pool_the_quantiles_and_take_medians_of_the_rest() -> None:
    from octavo.bench.policies import PolicyResult, pooled_result

    def result(tput: float, freezes: tuple[float, ...], ttfts: tuple[float, ...]) -> PolicyResult:
        return PolicyResult(
            "forecast", tput, 0.1, 3, None, None, 0.0, 0.0, 0.0, 10.0, 100, 1000, freezes, ttfts
        )

    runs = [
        result(10.0, (1.0,), (0.1, 0.2)),
        result(30.0, (), (0.3,)),
        result(20.0, (5.0, 2.0), (0.4, 0.5)),
    ]
    pooled = pooled_result(runs)
    assert pooled.output_tokens_per_s == 20.0  # the median run
    # Over the three freezes of all runs: the median 2.0 and the largest, not a median of
    # per-run maxima.
    assert (pooled.median_freeze_s, pooled.p99_freeze_s) == (2.0, 5.0)
    assert (pooled.median_ttft_s, pooled.p99_ttft_s) == (0.3, 0.5)
    assert "freezes_s" not in pooled.summary()
