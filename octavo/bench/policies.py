"""`octavo bench policies`: the admission policies on one synthetic trace, in seconds.

The same trace (Poisson arrivals, prompts sharing a system prefix, long-tailed answer lengths,
a KV pool too small for the offered concurrency) is replayed once per policy through the real
Scheduler and KVCacheManager. The shared MockRunner (core/mock_runner.py) stands in for the
model: it ends each answer at its traced length, and a cost model advances a simulated clock
by a step time that grows with the prefill tokens and the decodes in the batch. Nothing
sleeps, so the times are simulated seconds; what differs between policies is only what the
scheduler decided.

Per policy it prints: output tok/s, the share of requests evicted at least once, the median
and p99 freeze (eviction -> the request's next token), the median time to first token, and
the redone prefill share (prompt and output tokens computed again after an eviction, over all
prefill tokens). It ends with one JSON line. `--on-model` measures the same table on the
real engine and model instead (bench/policies_model.py).

Must not: load a model or torch here, or reach into the engine: only `core` and `config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.admission import ADMISSION_POLICIES
from octavo.core.mock_runner import MockRunner
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.request import Request, ResolvedParams
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput

EOS_TOKEN_ID = 2
ANSWER_TOKEN_ID = 500
POLICIES = tuple(ADMISSION_POLICIES)


@dataclass(frozen=True)
class TraceConfig:
    num_requests: int = 300
    request_rate: float = 6.0  # requests per simulated second, Poisson
    system_prompt_len: int = 64  # shared by every prompt (prefix caching sees it)
    mean_prompt_len: int = 384  # user part: uniform in [mean / 2, 3 * mean / 2]
    median_answer_len: int = 200  # lognormal: with sigma 1, mean ~1.65x and p99 ~10x the median
    answer_sigma: float = 1.0
    max_tokens: int = 2048  # what every client sends
    seed: int = 0


@dataclass(frozen=True)
class CostModel:
    """Step time of a mid-size model on one accelerator: a fixed cost, then prefill tokens
    (compute-bound) and decodes (memory-bound, per request)."""

    step_s: float = 0.010
    prefill_token_s: float = 0.00005
    decode_s: float = 0.0002

    def step_time_s(self, num_prefill_tokens: int, num_decodes: int) -> float:
        return self.step_s + self.prefill_token_s * num_prefill_tokens + self.decode_s * num_decodes


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    # Where the "model" ends the answer (EOS), and what the client allows.
    answer_len: int
    max_tokens: int


def make_trace(config: TraceConfig) -> list[TraceRequest]:
    rng = random.Random(config.seed)
    system = [rng.randrange(1000, 30000) for _ in range(config.system_prompt_len)]
    mu = math.log(config.median_answer_len)
    trace = []
    arrival_s = 0.0
    for idx in range(config.num_requests):
        arrival_s += rng.expovariate(config.request_rate)
        num_user = rng.randint(config.mean_prompt_len // 2, 3 * config.mean_prompt_len // 2)
        prompt = system + [rng.randrange(1000, 30000) for _ in range(num_user)]
        answer_len = min(
            max(int(rng.lognormvariate(mu, config.answer_sigma)), 1), config.max_tokens
        )
        trace.append(TraceRequest(str(idx), arrival_s, prompt, answer_len, config.max_tokens))
    return trace


class CostModelExecutor:
    """Plays the model runner: the shared MockRunner writing ANSWER_TOKEN_ID until a request's
    traced answer length, then EOS; each step is priced by the cost model, and its prefill
    work is counted."""

    def __init__(self, answer_lens: dict[str, int], cost: CostModel) -> None:
        self.runner = MockRunner(
            ANSWER_TOKEN_ID + 1, EOS_TOKEN_ID, script=[ANSWER_TOKEN_ID], answer_lens=answer_lens
        )
        self.cost = cost
        self.num_prefill_tokens = 0
        self.num_redone_tokens = 0

    def execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        runner_output = self.runner.execute(out)
        work = self.runner.last_work
        self.num_prefill_tokens += work.num_prefill_tokens
        self.num_redone_tokens += work.num_redone_tokens
        return runner_output, self.cost.step_time_s(work.num_prefill_tokens, work.num_decodes)


@dataclass(slots=True)
class _Timeline:
    arrival_s: float
    first_token_s: float | None = None
    num_evictions: int = 0
    pending_evictions_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    output_tokens_per_s: float
    evicted_share: float
    num_preemptions: int
    median_freeze_s: float | None
    p99_freeze_s: float | None
    median_ttft_s: float
    p99_ttft_s: float
    redone_prefill_share: float
    elapsed_s: float
    num_steps: int
    num_output_tokens: int
    # The samples behind the quantiles, so that runs over several seeds pool them.
    freezes_s: tuple[float, ...] = field(default=(), repr=False)
    ttfts_s: tuple[float, ...] = field(default=(), repr=False)

    def summary(self) -> dict[str, object]:
        """The fields but the samples (the JSON line)."""
        fields = asdict(self)
        del fields["freezes_s"], fields["ttfts_s"]
        return fields


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    # Rounded first: 0.99 * 100 is 99.00000000000001 in floats.
    return ordered[max(math.ceil(round(q * len(ordered), 9)), 1) - 1]


def run_policy(
    trace: list[TraceRequest],
    admission: str,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    cost: CostModel,
) -> PolicyResult:
    """Replay `trace` through a Scheduler with the `admission` policy; simulated time."""
    config = SchedulerConfig(
        scheduler_config.max_num_seqs,
        scheduler_config.max_num_batched_tokens,
        scheduler_config.max_model_len,
        admission=admission,
        watermark=scheduler_config.watermark,
        preempt_victim=scheduler_config.preempt_victim,
    )
    scheduler = Scheduler(config, cache_config)
    executor = CostModelExecutor({t.request_id: t.answer_len for t in trace}, cost)
    pending = deque(sorted(trace, key=lambda t: t.arrival_s))
    timelines: dict[str, _Timeline] = {}
    freezes_s: list[float] = []
    clock_s = pending[0].arrival_s if pending else 0.0
    num_output_tokens = num_steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_s <= clock_s:
            item = pending.popleft()
            scheduler.add_request(_make_request(item))
            timelines[item.request_id] = _Timeline(item.arrival_s)
        if not scheduler.has_unfinished_requests():
            clock_s = pending[0].arrival_s
            continue
        out = scheduler.schedule()
        runner_output, step_s = executor.execute(out)
        step_start_s, clock_s = clock_s, clock_s + step_s
        num_steps += 1
        for request_id in out.preempted_req_ids:
            timeline = timelines[request_id]
            timeline.num_evictions += 1
            timeline.pending_evictions_s.append(step_start_s)
        for core_output in scheduler.update(out, runner_output):
            timeline = timelines[core_output.request_id]
            num_output_tokens += len(core_output.new_token_ids)
            if timeline.first_token_s is None:
                timeline.first_token_s = clock_s
            freezes_s.extend(clock_s - t for t in timeline.pending_evictions_s)
            timeline.pending_evictions_s.clear()
    scheduler.check_integrity()
    elapsed_s = clock_s - trace[0].arrival_s if trace else 0.0
    ttfts = [t.first_token_s - t.arrival_s for t in timelines.values()]
    return PolicyResult(
        policy=admission,
        output_tokens_per_s=num_output_tokens / elapsed_s if elapsed_s else 0.0,
        evicted_share=sum(1 for t in timelines.values() if t.num_evictions) / len(timelines),
        num_preemptions=scheduler.num_preemptions,
        median_freeze_s=quantile(freezes_s, 0.5),
        p99_freeze_s=quantile(freezes_s, 0.99),
        median_ttft_s=quantile(ttfts, 0.5) or 0.0,
        p99_ttft_s=quantile(ttfts, 0.99) or 0.0,
        redone_prefill_share=executor.num_redone_tokens / max(executor.num_prefill_tokens, 1),
        elapsed_s=elapsed_s,
        num_steps=num_steps,
        num_output_tokens=num_output_tokens,
        freezes_s=tuple(freezes_s),
        ttfts_s=tuple(ttfts),
    )


def _make_request(item: TraceRequest) -> Request:
    params = SamplingParams(max_tokens=item.max_tokens)
    resolved = ResolvedParams(item.max_tokens, frozenset({EOS_TOKEN_ID}))
    return Request(item.request_id, item.prompt_token_ids, params, resolved, item.arrival_s)


# --- the command ------------------------------------------------------------------------------

# `--trace` presets. long-answer: long-tailed answers under a generous max_tokens, the case
# where admitting against max_tokens wastes the pool. chat: shorter prompts and answers
# arriving faster, with a tighter spread.
TRACES: dict[str, TraceConfig] = {
    "long-answer": TraceConfig(),
    "chat": TraceConfig(
        num_requests=600,
        request_rate=24.0,
        system_prompt_len=128,
        mean_prompt_len=128,
        median_answer_len=100,
        answer_sigma=0.7,
        max_tokens=1024,
    ),
}
_TRACE_FIELDS = (
    "num_requests",
    "request_rate",
    "mean_prompt_len",
    "median_answer_len",
    "answer_sigma",
    "max_tokens",
)


def pooled_result(results: list[PolicyResult]) -> PolicyResult:
    """One policy's runs on several seeds as one: the freeze and TTFT quantiles over every
    request of every run (a p99 over one run's few evictions would be its maximum), the
    other columns the median over the runs."""

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    freezes = [f for r in results for f in r.freezes_s]
    ttfts = [t for r in results for t in r.ttfts_s]
    fields: dict[str, object] = {"policy": results[0].policy}
    for name in ("output_tokens_per_s", "evicted_share", "redone_prefill_share", "elapsed_s"):
        fields[name] = median([getattr(r, name) for r in results])
    for name in ("num_preemptions", "num_steps", "num_output_tokens"):
        fields[name] = round(median([getattr(r, name) for r in results]))
    return PolicyResult(
        **fields,
        median_freeze_s=quantile(freezes, 0.5),
        p99_freeze_s=quantile(freezes, 0.99),
        median_ttft_s=quantile(ttfts, 0.5) or 0.0,
        p99_ttft_s=quantile(ttfts, 0.99) or 0.0,
        freezes_s=tuple(freezes),
        ttfts_s=tuple(ttfts),
    )


def format_table(results: list[PolicyResult]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = (
        f"{'policy':<8} {'output tok/s':>12} {'TTFT p50 s':>10} {'TTFT p99 s':>10} "
        f"{'evicted':>8} {'freeze p50 s':>12} {'freeze p99 s':>12} {'redone prefill':>14} "
        f"{'preemptions':>11}"
    )
    rows = [header]
    for r in results:
        rows.append(
            f"{r.policy:<8} {r.output_tokens_per_s:>12.1f} {r.median_ttft_s:>10.2f} "
            f"{r.p99_ttft_s:>10.2f} {r.evicted_share:>8.1%} {seconds(r.median_freeze_s):>12} "
            f"{seconds(r.p99_freeze_s):>12} {r.redone_prefill_share:>14.1%} "
            f"{r.num_preemptions:>11}"
        )
    return "\n".join(rows)


def format_against_current(results: list[PolicyResult]) -> str:
    """Each policy over `current` in the terms of forecast's goal: throughput (want >= 0.95),
    p99 freeze and evicted share (want <= 0.25 each)."""
    base = next((r for r in results if r.policy == "current"), None)
    if base is None:
        return ""

    def ratio(value: float | None, reference: float | None) -> str:
        if not reference:
            return "-"
        return f"{(value or 0.0) / reference:.3f}"

    rows = [f"{'vs current':<10} {'throughput':>10} {'freeze p99':>10} {'evicted':>8}"]
    for r in results:
        if r is not base:
            rows.append(
                f"{r.policy:<10} {ratio(r.output_tokens_per_s, base.output_tokens_per_s):>10} "
                f"{ratio(r.p99_freeze_s, base.p99_freeze_s):>10} "
                f"{ratio(r.evicted_share, base.evicted_share):>8}"
            )
    return "\n".join(rows)


def add_policies_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        choices=list(TRACES),
        default="long-answer",
        help="the trace preset; the options below override its fields",
    )
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per simulated second"
    )
    parser.add_argument("--mean-prompt-len", type=int, default=None)
    parser.add_argument("--median-answer-len", type=int, default=None)
    parser.add_argument("--answer-sigma", type=float, default=None, help="lognormal sigma")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--watermark", type=float, default=0.0)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="replay this many traces (seeds dataset-seed, +1, ...): freeze and TTFT quantiles "
        "over all their requests, the other columns the median over the traces",
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument(
        "--on-model",
        action="store_true",
        help="replay in wall-clock time through the real engine and model "
        "instead of the cost model (use a small trace)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="with --on-model: HF folder or .gguf (default: the embedded one)",
    )
    parser.add_argument("--dtype", default="float32")


def run_policies_bench(ns: argparse.Namespace) -> int:
    overrides = {f: getattr(ns, f) for f in _TRACE_FIELDS if getattr(ns, f) is not None}
    trace_config = dataclasses.replace(TRACES[ns.trace], seed=ns.dataset_seed, **overrides)
    if ns.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {ns.seeds}.")
    traces = [
        make_trace(dataclasses.replace(trace_config, seed=ns.dataset_seed + i))
        for i in range(ns.seeds)
    ]
    trace = traces[0]
    max_model_len = max(len(t.prompt_token_ids) + t.max_tokens for tr in traces for t in tr)
    cache_config = CacheConfig(ns.block_size, -(-ns.kv_cache_tokens // ns.block_size))
    if max_model_len > cache_config.num_tokens:
        raise ValueError(
            f"kv_cache_tokens={ns.kv_cache_tokens} cannot hold one request of the trace "
            f"({max_model_len} tokens): raise it or lower --max-tokens."
        )
    scheduler_config = SchedulerConfig(
        ns.max_num_seqs, ns.max_num_batched_tokens, max_model_len, watermark=ns.watermark
    )
    cost = CostModel()
    if ns.on_model:
        return _run_on_model(ns, trace, trace_config, max_model_len)
    print(
        "config:",
        json.dumps(
            {
                "trace": ns.trace,
                "trace_config": asdict(trace_config),
                "seeds": ns.seeds,
                "cost_model": asdict(cost),
                "kv_cache_tokens": cache_config.num_tokens,
                "block_size": ns.block_size,
                "max_num_seqs": ns.max_num_seqs,
                "max_num_batched_tokens": ns.max_num_batched_tokens,
                "watermark": ns.watermark,
            }
        ),
    )
    answers = sorted(t.answer_len for t in trace)
    print(
        f"trace {ns.trace}: {len(trace)} requests over {trace[-1].arrival_s:.1f} simulated s; "
        f"answer tokens median {answers[len(answers) // 2]}, max {answers[-1]}"
        + (f" (seed {ns.dataset_seed}; {ns.seeds} seeds pooled below)" if ns.seeds > 1 else "")
        + "; times are simulated seconds"
    )
    results = [
        pooled_result([run_policy(t, policy, cache_config, scheduler_config, cost) for t in traces])
        for policy in ns.policies
    ]
    print(format_table(results))
    against = format_against_current(results)
    if against:
        print(against)
    print(json.dumps({"policies": [r.summary() for r in results]}))
    return 0


def _run_on_model(
    ns: argparse.Namespace,
    trace: list[TraceRequest],
    trace_config: TraceConfig,
    max_model_len: int,
) -> int:
    from octavo.bench.policies_model import run_policy_on_model
    from octavo.config import EngineArgs

    engine_args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        max_model_len=max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_tokens=ns.kv_cache_tokens,
        block_size=ns.block_size,
        watermark=ns.watermark,
    )
    print("config:", json.dumps({"trace": asdict(trace_config), "engine": asdict(engine_args)}))
    print(
        f"trace: {len(trace)} requests over {trace[-1].arrival_s:.1f} s, replayed on the "
        "model in wall-clock time"
    )
    results = [run_policy_on_model(trace, policy, engine_args) for policy in ns.policies]
    print(format_table(results))
    against = format_against_current(results)
    if against:
        print(against)
    print(json.dumps({"policies": [r.summary() for r in results]}))
    return 0
