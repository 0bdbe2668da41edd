"""Prometheus exposition of engine stats, with vLLM's metric names, types and labels.

Owns one CollectorRegistry per logger (so several engines or test servers in one process do
not collide) and the metric objects in it, the process's own collectors (`process_*`,
`python_*`) included. Stats come in as snapshot dataclasses from `metrics.stats`; Prometheus
text goes out. Every series carries vLLM's labels `model_name` and `engine` (the engine's index,
"0" for one engine; `vllm:request_success` adds `finished_reason`); never a per-request label.
The exceptions are vLLM's too: `vllm:cache_config_info` is labelled by the settings and the
engine, `vllm:sleep_mode_operation_duration_seconds` by the operation only.
Metrics vLLM does not have are named `octavo:*`.

Must not: import the engine or the server, or compute stats itself (callers hand them over).
`record` runs on the engine thread and `render` on the server's event loop: prometheus_client
metrics are thread-safe, so no lock is needed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from octavo.core.request import FinishReason
from octavo.metrics.stats import (
    ADMISSION_REASONS,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)

if TYPE_CHECKING:
    from octavo.config import EngineConfig

LABEL_NAMES = ["model_name", "engine"]
FINISH_REASONS = tuple(FinishReason)

# vLLM's buckets, so that dashboards built on its quantiles read the same.
TTFT_BUCKETS_S = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS_S = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS_S = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
# vLLM's buckets of the number of times a request was preempted.
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
# vLLM's buckets of the n request parameter and of tokens per engine step.
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# vLLM's label values: why a request waits, and where a prompt token's KV came from (octavo
# has no KV connector, so nothing comes from another instance: that series stays at 0).
WAITING_REASONS = ("capacity", "deferred")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's cache tiers a prefix hit can come from; octavo's prefix cache is the device's own.
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")

# vLLM's sleep states (awake, or asleep at level 1 or 2) and the buckets of how long one
# sleep-mode operation ("sleep", "wake") took.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
SLEEP_MODE_OPERATION_BUCKETS_S = [0.01, 0.1, 1, 10, 30, 60, 120, 300, 600]

# vLLM's buckets of a sampled KV block's lifetime, idle time and reuse gaps.
KV_BLOCK_RESIDENCY_BUCKETS_S = [
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    20,
    30,
    60,
    120,
    300,
    600,
    1200,
    1800,
]

# A freeze is a recomputation plus a wait for room: from a blink to minutes.
FREEZE_BUCKETS_S = [
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """vLLM's gauges for the scheduler's state, counters for tokens, requests, preemptions and
    prefix-cache lookups, and histograms of request latencies and lengths; plus octavo's
    eviction metrics.

    Counters are declared without the `_total` suffix; prometheus_client exposes them as
    `..._total`, which is what vLLM serves. The scheduler's cumulative counts are turned
    into increments against the last snapshot seen.

    One logger serves every engine of a server: each metric is one family, and each engine
    (a data-parallel replica) its own series in it, labelled `engine="<index>"` as vLLM's are.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 32768,
        cache_info: dict[str, str] | None = None,
        num_engines: int = 1,
        kv_cache_metrics: bool = False,
        num_speculative_tokens: int = 0,
    ) -> None:
        """num_speculative_tokens: with speculative decoding, the most proposed tokens per
        step (the vllm:spec_decode_* families are declared, one position label per token).
        cache_info: the KV cache's settings as vllm:cache_config_info labels (block_size,
        num_gpu_blocks, cache_dtype, enable_prefix_caching, ...), the same for every engine.
        kv_cache_metrics: export the sampled KV blocks' residency histograms (vLLM's
        --kv-cache-metrics; the engines' pools sample the blocks)."""
        self.registry = registry or CollectorRegistry()
        if registry is None:  # a registry of its own: the process's collectors join it
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            if GC_COLLECTOR is not None:
                GCCollector(registry=self.registry)
        families: dict[str, Any] = {}

        def family(kind: type, name: str, documentation: str, labelnames: list[str], **kw: Any):
            if name not in families:
                families[name] = kind(name, documentation, labelnames, registry=self.registry, **kw)
            return families[name]

        # The frontend's queue bounds (vLLM's, labelled by model and reason, not by engine).
        rejections = Counter(
            "vllm:admission_rejections",
            "Requests rejected at submission by a queue bound (--max-num-queued-reqs, "
            "--max-num-queued-tokens, or octavo's --max-queue-wait), by which.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.admission_rejections = {
            reason: rejections.labels(model_name=model_name, reason=reason)
            for reason in ADMISSION_REASONS
        }
        self._engines = [
            _EngineMetrics(
                family,
                {"model_name": model_name, "engine": str(index)},
                max_model_len,
                cache_info,
                kv_cache_metrics,
                num_speculative_tokens,
            )
            for index in range(num_engines)
        ]

    def record_admission_rejection(self, reason: str) -> None:
        """One request rejected by the queue bound `reason` (ADMISSION_REASONS)."""
        self.admission_rejections[reason].inc()

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None = None,
        engine_index: int = 0,
    ) -> None:
        """Take one step's snapshot of engine `engine_index`: gauges are set, counters and
        histograms get the step's increments."""
        self._engines[engine_index].record(scheduler_stats, iteration_stats)

    def render(self) -> bytes:
        """The registry in Prometheus text format (serve with `content_type`)."""
        return generate_latest(self.registry)


def stat_logger_for(config: EngineConfig, num_engines: int = 1) -> PrometheusStatLogger:
    """The logger of an engine of this configuration (`num_engines` replicas): its model name,
    lengths and KV cache settings as the metrics' labels and buckets want them."""
    cache = config.cache
    return PrometheusStatLogger(
        config.served_model_name,
        max_model_len=config.scheduler.max_model_len,
        cache_info={
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_blocks,
            "cache_dtype": cache.dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "sliding_window": cache.sliding_window,
        },
        num_engines=num_engines,
        kv_cache_metrics=cache.kv_cache_metrics_sample > 0,
        num_speculative_tokens=(
            config.speculative.num_speculative_tokens if config.speculative else 0
        ),
    )


class _EngineMetrics:
    """One engine's series in each family, and its last cumulative counts."""

    def __init__(
        self,
        family: Callable[..., Any],
        labels: dict[str, str],
        max_model_len: int,
        cache_info: dict[str, str] | None,
        kv_cache_metrics: bool,
        num_speculative_tokens: int = 0,
    ) -> None:
        def gauge(name: str, documentation: str) -> Gauge:
            return family(Gauge, name, documentation, LABEL_NAMES).labels(**labels)

        def counter(name: str, documentation: str) -> Counter:
            return family(Counter, name, documentation, LABEL_NAMES).labels(**labels)

        def histogram(name: str, documentation: str, buckets: list[float]) -> Histogram:
            return family(Histogram, name, documentation, LABEL_NAMES, buckets=buckets).labels(
                **labels
            )

        # Scheduler state.
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        waiting_by_reason = family(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by why they wait: 'capacity' for room in the batch or the KV "
            "cache, 'deferred' for a structured-output grammar still compiling. The reasons "
            "add up to vllm:num_requests_waiting.",
            [*LABEL_NAMES, "reason"],
        )
        self.num_requests_waiting_by_reason = {
            reason: waiting_by_reason.labels(**labels, reason=reason) for reason in WAITING_REASONS
        }
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        sleep_state = family(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state: 1 for the state the engine is in (awake; asleep at level 1, "
            "weights_offloaded; at level 2, discard_all), 0 for the others; all 0 at level 0.",
            [*LABEL_NAMES, "sleep_state"],
        )
        self.engine_sleep_state = {
            state: sleep_state.labels(**labels, sleep_state=state) for state in SLEEP_STATES
        }
        self.engine_sleep_state["awake"].set(1)
        # As vLLM's, labelled by the operation only: its series appear once one has run.
        self.sleep_mode_operation_duration = family(
            Histogram,
            "vllm:sleep_mode_operation_duration_seconds",
            "Duration of one sleep-mode operation.",
            ["operation"],
            buckets=SLEEP_MODE_OPERATION_BUCKETS_S,
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        # Tokens and requests.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = family(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: computed by a prefill here "
            "(local_compute), found in the prefix cache (local_cache_hit), or received from "
            "another instance (external_kv_transfer).",
            [*LABEL_NAMES, "source"],
        )
        self.prompt_tokens_by_source = {
            source: by_source.labels(**labels, source=source) for source in PROMPT_TOKEN_SOURCES
        }
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens whose KV was reused rather than computed (prefix cache and external).",
        )
        cached_by_source = family(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hits in tokens, counted at admission, by the tier that held them: "
            "device (the engine's own KV cache), host, disk, p2p (another instance), "
            "external_unspecified.",
            [*LABEL_NAMES, "source"],
        )
        self.prompt_tokens_cached_by_source = {
            source: cached_by_source.labels(**labels, source=source) for source in CACHE_HIT_SOURCES
        }
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = family(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABEL_NAMES, "finished_reason"],
        )
        # Every reason is exported from the start, at 0, as vLLM does.
        self.request_success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS
        }
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS_S,
        )
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets,
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n",
            "The n parameter (completions asked for) of each finished request.",
            REQUEST_PARAMS_N_BUCKETS,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "For each finished request, the most tokens one of its n completions generated.",
            token_buckets,
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "For each finished request, the prompt tokens its prefill computed (prefix-cache "
            "hits left out).",
            token_buckets,
        )
        # Sampled KV blocks' residency, exported only where sampled, as vLLM's are.
        self.kv_block_residency: tuple[Histogram, Histogram, Histogram] | None = None
        if kv_cache_metrics:
            self.kv_block_residency = (
                histogram(
                    "vllm:kv_block_lifetime_seconds",
                    "Histogram of KV cache block lifetime from allocation to eviction. "
                    "Sampled metrics (controlled by --kv-cache-metrics-sample).",
                    KV_BLOCK_RESIDENCY_BUCKETS_S,
                ),
                histogram(
                    "vllm:kv_block_idle_before_evict_seconds",
                    "Histogram of idle time before KV cache block eviction. Sampled metrics "
                    "(controlled by --kv-cache-metrics-sample).",
                    KV_BLOCK_RESIDENCY_BUCKETS_S,
                ),
                histogram(
                    "vllm:kv_block_reuse_gap_seconds",
                    "Histogram of time gaps between consecutive KV cache block accesses. Only "
                    "the most recent accesses are recorded (ring buffer). Sampled metrics "
                    "(controlled by --kv-cache-metrics-sample).",
                    KV_BLOCK_RESIDENCY_BUCKETS_S,
                ),
            )
        if cache_info is not None:
            # An info metric as vLLM exports it: a gauge at 1 whose labels are the settings.
            info = {**{k: str(v) for k, v in cache_info.items()}, "engine": labels["engine"]}
            family(
                Gauge,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(info),
            ).labels(**info).set(1)
        # Evictions, which no other engine shows.
        self.request_max_token_gap = histogram(
            "octavo:request_max_token_gap_seconds",
            "Histogram of the largest gap between two tokens of a request after its first.",
            FREEZE_BUCKETS_S,
        )
        self.num_requests_evicted = counter(
            "octavo:num_requests_evicted",
            "Number of requests evicted (preempted) at least once.",
        )
        self.eviction_freeze = histogram(
            "octavo:eviction_freeze_seconds",
            "Histogram of the time from an eviction to the evicted request's next token.",
            FREEZE_BUCKETS_S,
        )
        self._last_num_preemptions = 0
        self._last_prefix_cache_queries = 0
        self._last_prefix_cache_hits = 0
        self.spec_decode = (
            _SpecDecodeMetrics(family, labels, num_speculative_tokens)
            if num_speculative_tokens
            else None
        )

    def record(
        self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None
    ) -> None:
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        num_deferred = min(scheduler_stats.num_deferred_reqs, scheduler_stats.num_waiting_reqs)
        self.num_requests_waiting_by_reason["deferred"].set(num_deferred)
        self.num_requests_waiting_by_reason["capacity"].set(
            scheduler_stats.num_waiting_reqs - num_deferred
        )
        self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
        level = scheduler_stats.sleep_level
        self.engine_sleep_state["awake"].set(level is None)
        self.engine_sleep_state["weights_offloaded"].set(level == 1)
        self.engine_sleep_state["discard_all"].set(level == 2)
        self._record_scheduler_counters(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_scheduler_counters(self, stats: SchedulerStats) -> None:
        # max(0, ...): a counter only goes up, even if a scheduler were replaced.
        self.num_preemptions.inc(max(stats.num_preemptions - self._last_num_preemptions, 0))
        self.prefix_cache_queries.inc(
            max(stats.prefix_cache_queries - self._last_prefix_cache_queries, 0)
        )
        num_new_hits = max(stats.prefix_cache_hits - self._last_prefix_cache_hits, 0)
        self.prefix_cache_hits.inc(num_new_hits)
        self.prompt_tokens_cached_by_source["device"].inc(num_new_hits)
        self._last_num_preemptions = stats.num_preemptions
        self._last_prefix_cache_queries = stats.prefix_cache_queries
        self._last_prefix_cache_hits = stats.prefix_cache_hits
        if self.spec_decode is not None and stats.spec_decoding is not None:
            self.spec_decode.record(stats.spec_decoding)

    def _record_iteration(self, iteration: IterationStats) -> None:
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        num_cached = iteration.num_cached_prompt_tokens
        self.prompt_tokens_by_source["local_compute"].inc(iteration.num_prompt_tokens - num_cached)
        self.prompt_tokens_by_source["local_cache_hit"].inc(num_cached)
        self.prompt_tokens_cached.inc(num_cached)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.num_scheduled_tokens:
            self.iteration_tokens.observe(iteration.num_scheduled_tokens)
        for ttft_s in iteration.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft_s)
        for itl_s in iteration.inter_token_latencies_s:
            self.inter_token_latency.observe(itl_s)
        for freeze_s in iteration.eviction_freezes_s:
            self.eviction_freeze.observe(freeze_s)
        self.num_requests_evicted.inc(iteration.num_newly_evicted_reqs)
        for finished in iteration.finished_requests:
            self._record_finished(finished)
        for n in iteration.n_params:
            self.request_params_n.observe(n)
        for num_tokens in iteration.max_num_generation_tokens:
            self.request_max_num_generation_tokens.observe(num_tokens)
        if self.kv_block_residency is not None:
            lifetime, idle, reuse_gap = self.kv_block_residency
            for seconds in iteration.kv_block_lifetimes_s:
                lifetime.observe(seconds)
            for seconds in iteration.kv_block_idle_before_evict_s:
                idle.observe(seconds)
            for seconds in iteration.kv_block_reuse_gaps_s:
                reuse_gap.observe(seconds)
        for operation, duration_s in iteration.sleep_mode_operations_s:
            self.sleep_mode_operation_duration.labels(operation=operation).observe(duration_s)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        success = self.request_success.get(finished.finish_reason)
        if success is not None:
            success.inc()
        self.e2e_request_latency.observe(finished.e2e_latency_s)
        self.request_queue_time.observe(finished.queue_time_s)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        self.request_params_max_tokens.observe(finished.max_tokens)
        self.request_num_preemptions.observe(finished.num_evictions)
        self.request_prefill_kv_computed_tokens.observe(
            finished.num_prompt_tokens - finished.num_cached_tokens
        )
        if finished.ttft_s is not None:
            self.request_prefill_time.observe(finished.prefill_time_s)
            self.request_decode_time.observe(finished.decode_time_s)
            self.request_inference_time.observe(finished.prefill_time_s + finished.decode_time_s)
            # The mean gap after the first token; 0 for a single token, as vLLM records it.
            self.request_time_per_output_token.observe(
                finished.decode_time_s / (finished.num_generation_tokens - 1)
                if finished.num_generation_tokens > 1
                else 0.0
            )
        if finished.num_generation_tokens >= 2:
            self.request_max_token_gap.observe(finished.max_token_gap_s)


class _SpecDecodeMetrics:
    """vLLM's speculative decoding counters of one engine, fed from its cumulative counts."""

    def __init__(
        self, family: Callable[..., Any], labels: dict[str, str], num_speculative_tokens: int
    ) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return family(Counter, name, documentation, LABEL_NAMES).labels(**labels)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = family(
            Counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABEL_NAMES, "position"],
        )
        self.num_accepted_tokens_per_pos = [
            per_pos.labels(**labels, position=str(pos)) for pos in range(num_speculative_tokens)
        ]
        self._last = SpecDecodingStats(num_accepted_tokens_per_pos=(0,) * num_speculative_tokens)

    def record(self, stats: SpecDecodingStats) -> None:
        last = self._last
        self.num_drafts.inc(max(stats.num_drafts - last.num_drafts, 0))
        self.num_draft_tokens.inc(max(stats.num_draft_tokens - last.num_draft_tokens, 0))
        self.num_accepted_tokens.inc(max(stats.num_accepted_tokens - last.num_accepted_tokens, 0))
        for series, now, before in zip(
            self.num_accepted_tokens_per_pos,
            stats.num_accepted_tokens_per_pos,
            last.num_accepted_tokens_per_pos,
        ):
            series.inc(max(now - before, 0))
        self._last = stats
