"""`octavo bench decode`: the time of one steady decode step, by batch size.

For each `--batch-sizes` entry N: N random-token prompts of `--context-len` tokens are
prefilled, a few warm-up steps run, then `--steps` decode steps of all N requests are timed one
by one (schedule, forward, sample, output processing: the whole engine step). Reports the
median and fastest step, N / median as decode tok/s and the KV the batch holds at the end
(blocks in use x block size as tokens, and in MiB: under sliding windows far less than the
context; with KV cache groups a block holds one group's layers); the
requests are then aborted (their blocks return to the pool) before the next size. This is
the number the CPU kernels are judged by (benchmarks/history/, "Decode steps"): serving
throughput adds prefill and the HTTP side on top of it. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from octavo.config import EngineArgs

_WARMUP_STEPS = 5


def add_decode_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes",
        default="1,8,32",
        help="comma-separated numbers of requests decoding together",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=256,
        help="prompt tokens of every request (context grows by one per step)",
    )
    parser.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    parser.add_argument("--dataset-seed", type=int, default=0)


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}.") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}.")
    return sizes


def run_decode_bench(ns: argparse.Namespace, args: EngineArgs) -> int:
    from octavo.bench.throughput import random_prompts
    from octavo.core.sampling_params import RequestOutputKind, SamplingParams
    from octavo.entrypoints.llm import LLM

    sizes = _batch_sizes(ns.batch_sizes)
    if ns.steps < 1 or ns.context_len < 1:
        raise ValueError("--steps and --context-len must be at least 1.")
    llm = LLM.from_engine_args(args)
    engine = llm.llm_engine
    if max(sizes) > engine.config.scheduler.max_num_seqs:
        raise ValueError(
            f"batch size {max(sizes)} is above --max-num-seqs "
            f"{engine.config.scheduler.max_num_seqs}."
        )
    # Requests prefilled in an early step of a large batch decode ahead of the others: give all
    # of them room to the end of the context window, and abort them once timed, so every timed
    # step decodes the whole batch.
    room = engine.config.scheduler.max_model_len - ns.context_len
    if room < _WARMUP_STEPS + ns.steps + 1:
        raise ValueError(
            f"--context-len {ns.context_len} leaves too few tokens before "
            f"max_model_len {engine.config.scheduler.max_model_len}."
        )
    print("config:", engine.config.to_json())
    params = SamplingParams(temperature=1.0, ignore_eos=True, seed=0, max_tokens=room)
    results = []
    for size in sizes:
        prompts = random_prompts(
            size, ns.context_len, engine.model_runner.vocab_size, ns.dataset_seed + size
        )
        request_ids = [f"decode-{size}-{i}" for i in range(size)]
        for request_id, prompt in zip(request_ids, prompts):
            engine.add_request(request_id, prompt, params, RequestOutputKind.FINAL_ONLY)
        # Prefill (in as many steps as the token budget needs), then warm-up decodes.
        scheduler = engine.scheduler
        while scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
        ):
            engine.step()
        for _ in range(_WARMUP_STEPS):
            engine.step()
        times_ms = []
        for _ in range(ns.steps):
            start = time.perf_counter()
            engine.step()
            times_ms.append((time.perf_counter() - start) * 1e3)
        # What the batch holds of the KV pool at its longest (a sliding window's blocks gone).
        kv = scheduler.kv_cache_manager
        blocks_in_use = kv.num_blocks - kv.num_free_blocks
        engine.abort_request(request_ids)
        while engine.has_unfinished_requests():
            engine.step()
        median = statistics.median(times_ms)
        results.append(
            {
                "batch_size": size,
                "step_ms_median": round(median, 2),
                "step_ms_min": round(min(times_ms), 2),
                "decode_tokens_per_s": round(size * 1e3 / median, 1),
                "kv_tokens_held": blocks_in_use * kv.block_size,
                "kv_mib_held": round(
                    blocks_in_use * kv.block_size * engine.config.cache.bytes_per_token / 2**20, 2
                ),
            }
        )
        print(
            f"batch {size:4d}: step {median:8.1f} ms median, {min(times_ms):8.1f} ms min, "
            f"{size * 1e3 / median:7.1f} decode tok/s, KV held {blocks_in_use * kv.block_size} "
            "tokens",
            flush=True,
        )
    print(
        json.dumps(
            {
                "context_len": ns.context_len,
                "steps": ns.steps,
                "dtype": engine.config.dtype,
                "results": results,
            }
        )
    )
    return 0
