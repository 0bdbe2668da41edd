"""`octavo bench throughput`: offline throughput of the engine on random-token prompts.

All requests are submitted at once (as vLLM's `benchmarks/throughput.py` does) with
`ignore_eos`, so every request produces exactly `--output-len` tokens and runs are comparable.
Prints the full configuration, requests/s, output tok/s and total tok/s, and ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from octavo.config import EngineArgs


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--dataset-seed", type=int, default=0)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_throughput(ns: argparse.Namespace, args: EngineArgs) -> int:
    from octavo.core.sampling_params import SamplingParams
    from octavo.entrypoints.llm import LLM

    llm = LLM.from_engine_args(args)
    engine = llm.llm_engine
    prompts = random_prompts(
        ns.num_prompts, ns.input_len, engine.model_runner.vocab_size, ns.dataset_seed
    )
    params = SamplingParams(temperature=1.0, max_tokens=ns.output_len, ignore_eos=True, seed=None)
    print("config:", engine.config.to_json())
    print(
        f"workload: {ns.num_prompts} prompts x {ns.input_len} input + {ns.output_len} output "
        "tokens, random token ids, ignore_eos"
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    stats = engine.make_stats()
    result = {
        "elapsed_s": round(elapsed, 3),
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "requests_per_s": round(len(outputs) / elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round((num_output + num_prompt) / elapsed, 2),
        "num_preemptions": stats.num_preemptions,
        "dtype": engine.config.dtype,
        "kv_cache_tokens": engine.config.cache.num_tokens,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
    }
    print(
        f"Throughput: {result['requests_per_s']} requests/s, "
        f"{result['output_tokens_per_s']} output tok/s, "
        f"{result['total_tokens_per_s']} total tok/s ({elapsed:.1f} s)"
    )
    print(json.dumps(result))
    return 0
