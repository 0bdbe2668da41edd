"""`octavo bench machine` measures and derives its ceilings consistently (values are machine
dependent, so the test checks the arithmetic between them, not the numbers)."""

from __future__ import annotations

import json

from octavo.entrypoints.cli import main


def test_bench_machine_ends_with_consistent_json(capsys) -> None:
    assert (
        main(
            [
                "bench",
                "machine",
                "--seconds",
                "0.02",
                "--num-params",
                "1e8",
                "--num-embedding-params",
                "2e7",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bandwidth = result["copy_bandwidth_gb_s"]
    assert bandwidth > 0 and result["float32_gflops_rows512"] > 0
    # batch 1: bandwidth / (params x 4 bytes); large batch: GFLOP/s / (2 x decoder params)
    # The JSON holds bandwidth rounded to 0.1 GB/s (0.05 x 2.5 = 0.125 tok/s here) and the
    # ceiling rounded to 0.1 (0.05).
    assert abs(result["float32_batch1_tokens_per_s_ceiling"] - bandwidth * 1e9 / 4e8) <= 0.2
    expected_large = result["float32_gflops_rows512"] * 1e9 / (2 * 8e7)
    # The JSON holds GFLOP/s rounded to 0.1 (up to 0.05 x 1e9 / 1.6e8 = 0.31 tok/s here).
    assert abs(result["float32_large_batch_tokens_per_s_ceiling"] - expected_large) <= 0.4
