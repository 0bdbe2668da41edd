"""PrometheusStatLogger and RequestLogWriter on hand-made stats: names, types and labels as
vLLM serves them, cumulative scheduler counts turned into increments, histograms fed from
IterationStats; the request log's lines."""

from __future__ import annotations

import json

import pytest

from octavo.metrics.prometheus import PrometheusStatLogger, build_1_2_5_buckets
from octavo.metrics.request_log import RequestLogWriter
from octavo.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

MODEL = {"model_name": "m", "engine": "0"}

# name as exposed -> Prometheus type
EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:prompt_tokens_by_source_total": "counter",
    "vllm:prompt_tokens_cached_total": "counter",
    "vllm:prompt_tokens_cached_by_source_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:sleep_mode_operation_duration_seconds": "histogram",
    "process_resident_memory_bytes": "gauge",
    "python_info": "gauge",
    "octavo:request_max_token_gap_seconds": "histogram",
    "octavo:num_requests_evicted_total": "counter",
    "octavo:eviction_freeze_seconds": "histogram",
}


def finished(request_id: str, reason: str, num_generation_tokens: int, **overrides):
    values = dict(
        request_id=request_id,
        finish_reason=reason,
        num_prompt_tokens=10,
        num_generation_tokens=num_generation_tokens,
        max_tokens=16,
        e2e_latency_s=2.0,
        queue_time_s=0.5,
        ttft_s=1.0,
        prefill_time_s=0.5,
        decode_time_s=1.0,
        max_token_gap_s=0.75,
        num_evictions=0,
    )
    values.update(overrides)
    return FinishedRequestStats(**values)


def test_every_metric_has_vllm_type_and_labels() -> None:
    cache = {"block_size": 16, "num_gpu_blocks": 64, "cache_dtype": "bfloat16"}
    text = PrometheusStatLogger("m", cache_info=cache).render().decode()
    types = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for name, kind in EXPECTED_TYPES.items():
        assert types.get(name) == kind, name
    for reason in ("stop", "length", "abort", "error"):
        labels = f'engine="0",finished_reason="{reason}",model_name="m"'
        assert f"vllm:request_success_total{{{labels}}} 0.0" in text
    # Every label value vLLM exports is there from the start, at 0.
    for name, label, values in (
        ("vllm:num_requests_waiting_by_reason", "reason", ("capacity", "deferred")),
        (
            "vllm:prompt_tokens_by_source_total",
            "source",
            ("local_compute", "local_cache_hit", "external_kv_transfer"),
        ),
        (
            "vllm:prompt_tokens_cached_by_source_total",
            "source",
            ("device", "host", "p2p", "disk", "external_unspecified"),
        ),
    ):
        for v in values:
            assert f'{name}{{engine="0",model_name="m",{label}="{v}"}} 0.0' in text
    info = 'block_size="16",cache_dtype="bfloat16",engine="0",num_gpu_blocks="64"'
    assert f"vllm:cache_config_info{{{info}}} 1.0" in text


def test_record_turns_stats_into_increments() -> None:
    logger = PrometheusStatLogger("m", max_model_len=100)
    value = logger.registry.get_sample_value
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            num_preemptions=2,
            prefix_cache_queries=40,
            prefix_cache_hits=16,
        )
    )
    logger.record(
        SchedulerStats(
            num_running_reqs=1,
            num_waiting_reqs=3,
            kv_cache_usage=0.5,
            num_preemptions=3,
            prefix_cache_queries=50,
            prefix_cache_hits=16,
            num_deferred_reqs=1,
        ),
        IterationStats(
            num_scheduled_tokens=12,
            num_prompt_tokens=10,
            num_cached_prompt_tokens=4,
            num_generation_tokens=2,
            num_preemptions=1,
            num_newly_evicted_reqs=1,
            time_to_first_tokens_s=[1.0],
            inter_token_latencies_s=[0.02, 3.0],
            eviction_freezes_s=[3.0],
            finished_requests=[
                finished(
                    "a", "stop", 5, num_evictions=1, eviction_freezes_s=(3.0,), num_cached_tokens=4
                ),
                finished("b", "abort", 0, ttft_s=None),
                finished("c", "length", 1),
            ],
            # One caller asked for n=2 (a and c, say), another for one completion.
            n_params=[2, 1],
            max_num_generation_tokens=[5, 0],
        ),
    )
    assert value("vllm:num_requests_running", MODEL) == 1
    assert value("vllm:num_requests_waiting", MODEL) == 3
    waiting_by_reason = "vllm:num_requests_waiting_by_reason"
    assert value(waiting_by_reason, {**MODEL, "reason": "capacity"}) == 2
    assert value(waiting_by_reason, {**MODEL, "reason": "deferred"}) == 1
    assert value("vllm:kv_cache_usage_perc", MODEL) == 0.5
    assert value("vllm:num_preemptions_total", MODEL) == 3
    assert value("vllm:prefix_cache_queries_total", MODEL) == 50
    assert value("vllm:prefix_cache_hits_total", MODEL) == 16
    cached_by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert value(cached_by_source, {**MODEL, "source": "device"}) == 16
    assert value(cached_by_source, {**MODEL, "source": "host"}) == 0
    assert value("vllm:prompt_tokens_total", MODEL) == 10
    assert value("vllm:generation_tokens_total", MODEL) == 2
    by_source = "vllm:prompt_tokens_by_source_total"
    assert value(by_source, {**MODEL, "source": "local_compute"}) == 6
    assert value(by_source, {**MODEL, "source": "local_cache_hit"}) == 4
    assert value(by_source, {**MODEL, "source": "external_kv_transfer"}) == 0
    assert value("vllm:prompt_tokens_cached_total", MODEL) == 4
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        labels = {**MODEL, "finished_reason": reason}
        assert value("vllm:request_success_total", labels) == count
    assert value("octavo:num_requests_evicted_total", MODEL) == 1
    assert value("vllm:iteration_tokens_total_sum", MODEL) == 12
    assert value("vllm:time_to_first_token_seconds_count", MODEL) == 1
    assert value("vllm:inter_token_latency_seconds_count", MODEL) == 2
    assert value("vllm:inter_token_latency_seconds_bucket", {**MODEL, "le": "0.025"}) == 1
    assert value("octavo:eviction_freeze_seconds_sum", MODEL) == 3.0
    assert value("vllm:e2e_request_latency_seconds_count", MODEL) == 3
    assert value("vllm:request_queue_time_seconds_sum", MODEL) == 1.5
    # Prefill and decode times only for requests that produced a token.
    assert value("vllm:request_prefill_time_seconds_count", MODEL) == 2
    assert value("vllm:request_decode_time_seconds_sum", MODEL) == 2.0
    assert value("vllm:request_prompt_tokens_sum", MODEL) == 30
    assert value("vllm:request_generation_tokens_sum", MODEL) == 6
    assert value("vllm:request_generation_tokens_bucket", {**MODEL, "le": "5.0"}) == 3
    # A gap needs two tokens: only "a".
    assert value("octavo:request_max_token_gap_seconds_count", MODEL) == 1
    # Running time (prefill + decode) for requests with a token; time per output token
    # (decode time over the tokens after the first) for those too, 0 for a single token:
    # "a" 1.0 / 4, "c" 0.
    assert value("vllm:request_inference_time_seconds_sum", MODEL) == 3.0
    assert value("vllm:request_time_per_output_token_seconds_sum", MODEL) == 0.25
    assert value("vllm:request_time_per_output_token_seconds_count", MODEL) == 2
    # Prompt tokens computed per request: a found 4 of its 10 in the cache.
    assert value("vllm:request_prefill_kv_computed_tokens_sum", MODEL) == 6 + 10 + 10
    assert value("vllm:request_params_n_count", MODEL) == 2
    assert value("vllm:request_params_n_bucket", {**MODEL, "le": "1.0"}) == 1
    assert value("vllm:request_params_n_bucket", {**MODEL, "le": "2.0"}) == 2
    assert value("vllm:request_max_num_generation_tokens_sum", MODEL) == 5
    assert value("vllm:request_params_max_tokens_sum", MODEL) == 48
    assert value("vllm:request_num_preemptions_sum", MODEL) == 1
    assert value("vllm:request_num_preemptions_bucket", {**MODEL, "le": "1.0"}) == 3


def test_sleep_state_and_sleep_mode_operations() -> None:
    """engine_sleep_state follows the snapshots' sleep level as vLLM's states name it;
    operation durations are labelled by the operation only, as vLLM's are."""
    logger = PrometheusStatLogger("m")
    value = logger.registry.get_sample_value

    def states() -> tuple[float | None, ...]:
        return tuple(
            value("vllm:engine_sleep_state", {**MODEL, "sleep_state": state})
            for state in ("awake", "weights_offloaded", "discard_all")
        )

    assert states() == (1, 0, 0)
    assert value("vllm:sleep_mode_operation_duration_seconds_count", {"operation": "sleep"}) is None
    logger.record(
        SchedulerStats(sleep_level=2),
        IterationStats(sleep_mode_operations_s=[("sleep", 0.5)]),
    )
    assert states() == (0, 0, 1)
    logger.record(SchedulerStats(sleep_level=1))
    assert states() == (0, 1, 0)
    logger.record(SchedulerStats(sleep_level=0))
    assert states() == (0, 0, 0)
    logger.record(SchedulerStats(), IterationStats(sleep_mode_operations_s=[("wake", 20.0)]))
    assert states() == (1, 0, 0)
    duration = "vllm:sleep_mode_operation_duration_seconds"
    assert value(f"{duration}_sum", {"operation": "sleep"}) == 0.5
    assert value(f"{duration}_bucket", {"operation": "wake", "le": "10.0"}) == 0
    assert value(f"{duration}_bucket", {"operation": "wake", "le": "30.0"}) == 1


def test_kv_block_residency_only_where_sampled() -> None:
    """vLLM's three residency histograms, with its buckets, exist only with kv_cache_metrics
    (--kv-cache-metrics) and take the iteration's sampled lives."""
    names = ("lifetime", "idle_before_evict", "reuse_gap")
    assert not any(
        f"vllm:kv_block_{name}_seconds" in PrometheusStatLogger("m").render().decode()
        for name in names
    )
    logger = PrometheusStatLogger("m", kv_cache_metrics=True)
    value = logger.registry.get_sample_value
    assert all(value(f"vllm:kv_block_{name}_seconds_count", MODEL) == 0 for name in names)
    logger.record(
        SchedulerStats(),
        IterationStats(
            kv_block_lifetimes_s=[7.0, 0.0015],
            kv_block_idle_before_evict_s=[2.0, 0.0015],
            kv_block_reuse_gaps_s=[1.5, 0.5, 1.5],
        ),
    )
    assert value("vllm:kv_block_lifetime_seconds_sum", MODEL) == pytest.approx(7.0015)
    assert value("vllm:kv_block_lifetime_seconds_bucket", {**MODEL, "le": "0.002"}) == 1
    assert value("vllm:kv_block_idle_before_evict_seconds_count", MODEL) == 2
    assert value("vllm:kv_block_reuse_gap_seconds_bucket", {**MODEL, "le": "1.0"}) == 1
    assert value("vllm:kv_block_reuse_gap_seconds_bucket", {**MODEL, "le": "1800.0"}) == 3


def test_each_engine_has_its_own_series_in_one_family() -> None:
    cache = {"block_size": "16", "num_gpu_blocks": "64"}
    logger = PrometheusStatLogger("m", cache_info=cache, num_engines=2)
    value = logger.registry.get_sample_value
    engine0, engine1 = MODEL, {**MODEL, "engine": "1"}
    logger.record(SchedulerStats(num_running_reqs=3, prefix_cache_hits=32), None, 0)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_hits=16), None, 1)
    # Each engine's cumulative counts are its own: 1's later snapshot adds only its increment.
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_hits=48), None, 1)
    assert value("vllm:num_requests_running", engine0) == 3
    assert value("vllm:num_requests_running", engine1) == 2
    assert value("vllm:prefix_cache_hits_total", engine0) == 32
    assert value("vllm:prefix_cache_hits_total", engine1) == 48
    text = logger.render().decode()
    # One family per name (a dashboard sums over `engine`), every engine's info series.
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    for engine in ("0", "1"):
        info = f'block_size="16",engine="{engine}",num_gpu_blocks="64"'
        assert f"vllm:cache_config_info{{{info}}} 1.0" in text


def test_combined_scheduler_stats_add_up_and_weigh_usage_by_blocks() -> None:
    combined = SchedulerStats.combined(
        [
            SchedulerStats(2, 1, 0.5, 1, 40, 16, 50, 100),
            SchedulerStats(1, 0, 0.25, 0, 10, 0, 225, 300),
        ]
    )
    assert combined == SchedulerStats(3, 1, (50 + 75) / 400, 1, 50, 16, 275, 400)
    assert SchedulerStats.combined([]) == SchedulerStats()
    # Asleep if any is, at the deepest level among them.
    asleep = [SchedulerStats(sleep_level=1), SchedulerStats(), SchedulerStats(sleep_level=0)]
    assert SchedulerStats.combined(asleep).sleep_level == 1


def test_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_request_log_lines(tmp_path) -> None:
    path = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(str(path))
    iteration = IterationStats(
        finished_requests=[
            finished("a", "stop", 5, num_evictions=2, eviction_freezes_s=(3.0, 1.0 / 3.0)),
            finished("b", "abort", 0, ttft_s=None, max_token_gap_s=0.0),
        ]
    )
    writer.record(SchedulerStats(), iteration)
    writer.record(SchedulerStats(), IterationStats())
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {
            "request_id": "a",
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "max_tokens": 16,
            "finish_reason": "stop",
            "ttft_s": 1.0,
            "max_token_gap_s": 0.75,
            "evictions": 2,
            "eviction_freezes_s": [3.0, 0.333333],
            "queue_time_s": 0.5,
            "e2e_latency_s": 2.0,
        },
        {
            "request_id": "b",
            "prompt_tokens": 10,
            "completion_tokens": 0,
            "max_tokens": 16,
            "finish_reason": "abort",
            "ttft_s": None,
            "max_token_gap_s": 0.0,
            "evictions": 0,
            "eviction_freezes_s": [],
            "queue_time_s": 0.5,
            "e2e_latency_s": 2.0,
        },
    ]
    with pytest.raises(ValueError, match="request_log="):
        RequestLogWriter(str(tmp_path / "missing-dir" / "x.jsonl"))
