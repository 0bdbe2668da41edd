"""Prometheus exposition of engine stats, with vLLM's metric names, types and labels.

Owns one CollectorRegistry per logger (so several engines or test servers in one process do
not collide) and the metric objects in it. Stats come in as plain numbers and snapshot
dataclasses from `metrics.stats`; Prometheus text goes out. Every series carries the one label
`model_name`; never a per-request label.

Must not: import the engine or the server, or compute stats itself (callers hand them over).
`record` runs on the engine thread and `render` on the server's event loop: prometheus_client
metrics are thread-safe, so no lock is needed here.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from octavo.metrics.stats import SchedulerStats

LABEL_NAMES = ["model_name"]


class PrometheusStatLogger:
    """vLLM's gauges for the scheduler's state and counters for tokens processed.

    Counters are declared without the `_total` suffix; prometheus_client exposes them as
    `vllm:prompt_tokens_total` and `vllm:generation_tokens_total`, which is what vLLM serves.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, LABEL_NAMES, registry=self.registry).labels(**labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABEL_NAMES, registry=self.registry).labels(
                **labels
            )

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )

    def record(
        self, scheduler_stats: SchedulerStats, num_prompt_tokens: int, num_generation_tokens: int
    ) -> None:
        """Take one step's snapshot: gauges are set, token counts (this step's) are added."""
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus text format (serve with `content_type`)."""
        return generate_latest(self.registry)
