"""`octavo plan` on hand-made request logs: each number equals its formula."""

from __future__ import annotations

import json

import pytest

from octavo.bench.plan import make_plan, percentile, read_request_log
from octavo.entrypoints.cli import main


def record(prompt: int, completion: int, reason: str = "stop") -> str:
    return json.dumps(
        {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "max_tokens": 4096,
            "finish_reason": reason,
            "evictions": 0,
        }
    )


def test_percentile_is_nearest_rank() -> None:
    values = list(range(10, 210, 10))  # 20 values
    assert percentile(values, 95) == 190  # rank ceil(19.0) = 19
    assert percentile(values, 99.9) == 200  # rank ceil(19.98) = 20
    assert percentile(values, 50) == 100
    assert percentile([7], 99.9) == 7


def test_plan_formulas(tmp_path, capsys) -> None:
    # Prompts: ten of 100 and ten of 300 (mean 200); answers 10, 20, ..., 200 (mean 105);
    # an aborted request is left out.
    lines = [record(100 if i < 10 else 300, 10 * (i + 1)) for i in range(20)]
    lines.insert(3, record(5000, 5000, "abort"))
    lines.append("")
    plan = make_plan(read_request_log(lines), kv_cache_tokens=10_000)
    assert (plan.num_requests, plan.num_aborted) == (20, 1)
    assert (plan.mean_prompt_tokens, plan.mean_completion_tokens) == (200.0, 105.0)
    assert (plan.p95_completion_tokens, plan.p999_completion_tokens) == (190, 200)
    # p99.9 + 10 %, and no logged answer is longer.
    assert (plan.recommended_max_tokens, plan.cut_share) == (220, 0.0)
    assert plan.max_num_seqs_no_eviction == 10_000 // (200 + 190) == 25
    assert plan.max_num_seqs_full_pool == 10_000 // (200 + 105) == 32

    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines))
    assert main(["plan", str(path), "--kv-cache-tokens", "10000"]) == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs 25" in out and "--max-num-seqs 32 --admission ratio" in out
    assert json.loads(out.strip().splitlines()[-1])["recommended_max_tokens"] == 220


def test_plan_reports_the_share_it_cuts() -> None:
    # 2000 answers: 1998 of 100 tokens and 2 of 5000. p99.9 is rank 1998: 100.
    lines = [record(50, 100)] * 1998 + [record(50, 5000)] * 2
    plan = make_plan(read_request_log(lines), kv_cache_tokens=4096)
    assert (plan.p95_completion_tokens, plan.p999_completion_tokens) == (100, 100)
    assert plan.recommended_max_tokens == 110 and plan.cut_share == 2 / 2000
    assert plan.mean_completion_tokens == (1998 * 100 + 2 * 5000) / 2000
    assert plan.max_num_seqs_no_eviction == 4096 // 150 == 27
    assert plan.max_num_seqs_full_pool == int(4096 // (50 + 104.9)) == 26


def test_bad_logs_are_named(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="line 2"):
        read_request_log([record(1, 1), '{"prompt_tokens": 3}'])
    with pytest.raises(ValueError, match="no finished"):
        make_plan(read_request_log([record(1, 1, "abort")]), 100)
    assert main(["plan", str(tmp_path / "none.jsonl"), "--kv-cache-tokens", "100"]) == 2
    assert "cannot read the request log" in capsys.readouterr().err
