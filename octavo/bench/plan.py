"""`octavo plan PATH --kv-cache-tokens N`: capacity planning from a request log.

Reads the JSON lines `--request-log` writes (prompt_tokens, completion_tokens, finish_reason)
and answers the two questions a KV pool raises:

- which `max_tokens` to send: a little (10 %, rounded up) above the 99.9th percentile answer,
  with the share of the logged answers it would have cut;
- how many requests to run at once: pool / (mean prompt + p95 answer) almost never evicts,
  pool / (mean prompt + mean answer) fills the pool on an average mix (and evicts when long
  answers bunch up, unless `--admission reserve|ratio` trades that for queueing).

Percentiles are nearest-rank (a value that was logged). Aborted requests are left out: their
answers were cut by the client, not written to the end. Plain Python, no engine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from octavo.core.request import FinishReason


@dataclass(frozen=True)
class CapacityPlan:
    kv_cache_tokens: int
    num_requests: int
    num_aborted: int
    mean_prompt_tokens: float
    mean_completion_tokens: float
    p95_completion_tokens: int
    p999_completion_tokens: int
    # A little above p99.9, and the share of logged answers longer than it.
    recommended_max_tokens: int
    cut_share: float
    # pool // (mean prompt + p95 answer): evictions almost never happen.
    max_num_seqs_no_eviction: int
    # pool // (mean prompt + mean answer): the pool is full on an average mix.
    max_num_seqs_full_pool: int


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of ascending values: the smallest value with at least q % of
    the values at or below it."""
    if not sorted_values:
        raise ValueError("percentile of no values.")
    # Rounded first: 99.9 / 100 * 2000 is 1998.0000000000002 in floats, rank 1998 not 1999.
    rank = max(math.ceil(round(q / 100 * len(sorted_values), 9)), 1)
    return sorted_values[rank - 1]


def read_request_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The log's records; blank lines are skipped. Raises ValueError naming the line."""
    records = []
    for line_idx, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record.get("prompt_tokens"), int) or not isinstance(
                record.get("completion_tokens"), int
            ):
                raise ValueError("needs integer prompt_tokens and completion_tokens")
        except (ValueError, AttributeError) as exc:
            raise ValueError(
                f"request log line {line_idx} is not a request record: {exc}"
            ) from None
        records.append(record)
    return records


def make_plan(records: list[dict[str, Any]], kv_cache_tokens: int) -> CapacityPlan:
    if kv_cache_tokens < 1:
        raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}.")
    kept = [r for r in records if r.get("finish_reason") != FinishReason.ABORT]
    if not kept:
        raise ValueError("the request log holds no finished (non-aborted) request.")
    prompts = [r["prompt_tokens"] for r in kept]
    answers = sorted(r["completion_tokens"] for r in kept)
    mean_prompt = sum(prompts) / len(prompts)
    mean_answer = sum(answers) / len(answers)
    p95 = percentile(answers, 95)
    p999 = percentile(answers, 99.9)
    # 10 % headroom in integers (1.1 * 200 is 220.00000000000003 in floats).
    recommended = max(p999 + -(-p999 // 10), 1)
    num_cut = sum(1 for answer in answers if answer > recommended)
    return CapacityPlan(
        kv_cache_tokens=kv_cache_tokens,
        num_requests=len(kept),
        num_aborted=len(records) - len(kept),
        mean_prompt_tokens=mean_prompt,
        mean_completion_tokens=mean_answer,
        p95_completion_tokens=p95,
        p999_completion_tokens=p999,
        recommended_max_tokens=recommended,
        cut_share=num_cut / len(answers),
        max_num_seqs_no_eviction=int(kv_cache_tokens // (mean_prompt + p95)),
        max_num_seqs_full_pool=int(kv_cache_tokens // (mean_prompt + mean_answer)),
    )


def format_plan(plan: CapacityPlan) -> str:
    no_eviction = max(plan.max_num_seqs_no_eviction, 1)
    full_pool = max(plan.max_num_seqs_full_pool, 1)
    return "\n".join(
        [
            f"requests: {plan.num_requests} ({plan.num_aborted} aborted, left out); KV pool "
            f"{plan.kv_cache_tokens} tokens",
            f"prompt tokens: mean {plan.mean_prompt_tokens:.1f}; answer tokens: mean "
            f"{plan.mean_completion_tokens:.1f}, p95 {plan.p95_completion_tokens}, p99.9 "
            f"{plan.p999_completion_tokens}",
            f"max_tokens: send {plan.recommended_max_tokens} (cuts {plan.cut_share:.2%} of the "
            "logged answers)",
            f"concurrency without evictions: {plan.max_num_seqs_no_eviction} "
            "(pool / (mean prompt + p95 answer))",
            f"concurrency that fills the pool on an average mix: {plan.max_num_seqs_full_pool} "
            "(pool / (mean prompt + mean answer))",
            "flags:",
            f"  streams must never freeze:  --max-num-seqs {no_eviction}",
            f"  throughput first:           --max-num-seqs {full_pool} --admission current",
            f"  throughput, fewer freezes:  --max-num-seqs {full_pool} --admission ratio",
        ]
    )


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a request log written with --request-log")
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        required=True,
        help="the KV pool to plan for, in tokens (the start-up capacity line)",
    )


def run_plan(ns: argparse.Namespace) -> int:
    try:
        with open(ns.path, encoding="utf-8") as log:
            records = read_request_log(log)
    except OSError as exc:
        raise ValueError(f"cannot read the request log {ns.path!r}: {exc}") from None
    plan = make_plan(records, ns.kv_cache_tokens)
    print(format_plan(plan))
    print(json.dumps(asdict(plan)))
    sys.stdout.flush()
    return 0
