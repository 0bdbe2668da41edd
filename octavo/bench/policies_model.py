"""`octavo bench policies --model`: the policy table measured on the real engine and model.

The same kind of trace as the cost-model run (bench/policies.py), smaller, replayed in wall-
clock time through an LLMEngine per policy: requests are added when their arrival time has
passed, the engine is stepped, and each answer is ended at its traced length by the client
(an abort: the scheduler cannot know when, as with EOS), with `ignore_eos` so the model's own
EOS does not end it earlier. Every client sends the same `max_tokens`.

Freezes, TTFT and evictions come from the engine's own stats (a stat logger read by duck
typing: `bench` may not import `metrics`). The redone prefill share is derived from the prefix
cache counters: tokens computed at admissions (queries - hits) beyond what the first
admissions computed (prompt - cached tokens), over the former.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from octavo.bench.policies import PolicyResult, TraceRequest, quantile
from octavo.config import EngineArgs


class _StatsCollector:
    """A stat logger for the engine: keeps freezes, TTFTs and the scheduler's counters."""

    def __init__(self) -> None:
        self.freezes_s: list[float] = []
        self.ttfts_s: list[float] = []
        self.num_evicted_reqs = 0
        self.scheduler_stats: Any = None

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        self.freezes_s.extend(iteration_stats.eviction_freezes_s)
        self.ttfts_s.extend(iteration_stats.time_to_first_tokens_s)
        self.num_evicted_reqs += iteration_stats.num_newly_evicted_reqs
        self.scheduler_stats = scheduler_stats


def run_policy_on_model(
    trace: list[TraceRequest], admission: str, engine_args: EngineArgs
) -> PolicyResult:
    """Replay `trace` (arrivals in seconds from now) through a fresh engine with `admission`."""
    from octavo.core.sampling_params import SamplingParams
    from octavo.entrypoints.llm import LLM, OutputKind

    llm = LLM.from_engine_args(dataclasses.replace(engine_args, admission=admission))
    engine = llm.llm_engine
    collector = _StatsCollector()
    engine.add_stat_logger(collector)
    answer_lens = {t.request_id: t.answer_len for t in trace}
    num_received: dict[str, int] = {}
    num_first_computed = 0
    num_output_tokens = num_steps = 0
    pending = deque(sorted(trace, key=lambda t: t.arrival_s))
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now_s = time.monotonic() - start
        while pending and pending[0].arrival_s <= now_s:
            item = pending.popleft()
            params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(
                item.request_id,
                item.prompt_token_ids,
                params,
                OutputKind.DELTA,
                start + item.arrival_s,
            )
            num_received[item.request_id] = 0
        if not engine.has_unfinished_requests():
            time.sleep(max(pending[0].arrival_s - now_s, 0.0))
            continue
        to_end: list[str] = []
        for output in engine.step():
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if num_new and num_received[output.request_id] == 0:
                num_first_computed += len(output.prompt_token_ids) - output.num_cached_tokens
            num_received[output.request_id] += num_new
            num_output_tokens += num_new
            if (
                not output.finished
                and num_received[output.request_id] >= answer_lens[output.request_id]
            ):
                to_end.append(output.request_id)
        engine.abort_request(to_end)
        num_steps += 1
    elapsed_s = time.monotonic() - start - trace[0].arrival_s
    stats = collector.scheduler_stats
    num_computed = stats.prefix_cache_queries - stats.prefix_cache_hits
    return PolicyResult(
        policy=admission,
        output_tokens_per_s=num_output_tokens / elapsed_s,
        evicted_share=collector.num_evicted_reqs / len(trace),
        num_preemptions=stats.num_preemptions,
        median_freeze_s=quantile(collector.freezes_s, 0.5),
        p99_freeze_s=quantile(collector.freezes_s, 0.99),
        median_ttft_s=quantile(collector.ttfts_s, 0.5) or 0.0,
        p99_ttft_s=quantile(collector.ttfts_s, 0.99) or 0.0,
        redone_prefill_share=max(num_computed - num_first_computed, 0) / max(num_computed, 1),
        elapsed_s=elapsed_s,
        num_steps=num_steps,
        num_output_tokens=num_output_tokens,
        freezes_s=tuple(collector.freezes_s),
        ttfts_s=tuple(collector.ttfts_s),
    )
