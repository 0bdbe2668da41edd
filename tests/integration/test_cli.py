"""`octavo generate`, `octavo chat` and `octavo bench throughput` run in-process on the
embedded model (the session fixture shares its weights)."""

from __future__ import annotations

import io
import json

import pytest

from octavo.config import EngineArgs
from octavo.core.sampling_params import SamplingParams
from octavo.entrypoints.chat import run_chat
from octavo.entrypoints.cli import main

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-tokens", "4096"]


def test_generate_prints_the_greedy_completion(capsys, llm) -> None:
    expected = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    assert main(["generate", "The capital of France is", "--max-tokens", "12", *ENGINE_FLAGS]) == 0
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"


def test_chat_streams_replies_and_keeps_history() -> None:
    args = EngineArgs(dtype="float32", max_model_len=512, kv_cache_tokens=4096)
    stdin = io.StringIO("Name three colors.\nAnd three animals?\n")
    stdout = io.StringIO()
    assert run_chat(args, SamplingParams(temperature=0.0, max_tokens=20), None, stdin, stdout) == 0
    lines = stdout.getvalue().split("> ")
    assert len(lines) == 4  # banner, two replies, the prompt that met EOF
    assert all(reply.strip() for reply in lines[1:3])


def test_bad_settings_exit_with_a_clear_error(capsys) -> None:
    assert main(["generate", "hi", "--model", "/nonexistent/model", *ENGINE_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "/nonexistent/model" in err
    assert "Traceback" not in err


def test_bench_throughput_ends_with_a_json_line(capsys) -> None:
    code = main(
        [
            "bench",
            "throughput",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--num-prompts",
            "4",
            *ENGINE_FLAGS,
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 4 and result["output_tokens_per_s"] > 0


def test_bench_decode_times_every_batch_size(capsys) -> None:
    code = main(
        [
            "bench",
            "decode",
            "--batch-sizes",
            "1,3",
            "--context-len",
            "20",
            "--steps",
            "2",
            *ENGINE_FLAGS,
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch_size"] for r in result["results"]] == [1, 3]
    for row in result["results"]:
        assert 0 < row["step_ms_min"] <= row["step_ms_median"]
        # Both figures are rounded (the step to 0.01 ms, the rate to 0.1 token/s).
        rate = row["batch_size"] * 1e3 / row["step_ms_median"]
        slack = rate * 0.005 / row["step_ms_median"] + 0.05
        assert abs(row["decode_tokens_per_s"] - rate) <= slack * 1.01
        # Every request holds its context (20 prompt tokens, the warm-up and timed steps).
        assert row["kv_tokens_held"] >= row["batch_size"] * (20 + 5 + 2)


def test_bench_decode_rejects_bad_batch_sizes(capsys) -> None:
    assert main(["bench", "decode", "--batch-sizes", "1,x", *ENGINE_FLAGS]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
