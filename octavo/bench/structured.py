"""`octavo bench structured`: what structured outputs cost the engine.

Two batches in one session, run alternately `--repeats` times (best of each reported): every
request unconstrained, and the same prompts with a share of them (`--structured-share`, half
by default) under a JSON schema. The schema asks
for a long array, so constrained requests run to `--output-len` like the unconstrained ones
(with `ignore_eos`): both runs produce the same number of tokens and their output tok/s
compare directly. Then the time to validate and compile new schemas (each one distinct, so
nothing is cached), with the engine idle. Prints the full configuration and ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from octavo.config import EngineArgs
from octavo.core.sampling_params import SamplingParams, StructuredOutputsParams


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--structured-share",
        type=float,
        default=0.5,
        help="share of the requests that carry the JSON schema",
    )
    parser.add_argument(
        "--num-schemas",
        type=int,
        default=8,
        help="new schemas compiled one by one to time compilation",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each batch, alternating; the best of each is reported",
    )


def inventory_schema(tag: int = 0) -> dict[str, Any]:
    """A list of items, at least 100: outputs last as long as the token budget allows. `tag`
    renames a property, which makes a distinct schema (a cache miss)."""
    item = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            f"qty_{tag}": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["tool", "food", "toy"]},
        },
        "required": ["name", f"qty_{tag}", "kind"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": 100}},
        "required": ["items"],
        "additionalProperties": False,
    }


def _run_batch(llm: Any, prompts: list[Any], params: list[SamplingParams]) -> dict[str, float]:
    engine = llm.llm_engine
    manager = engine.structured_output
    mask_s_before = manager.bitmask_seconds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens": num_output,
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "bitmask_fill_s": round(manager.bitmask_seconds - mask_s_before, 4),
    }


def _time_compilation(llm: Any, num_schemas: int) -> dict[str, float]:
    """Validation (before admission, on the caller's thread) and compilation (background
    thread, until the grammar is ready) of `num_schemas` new schemas, in milliseconds."""
    manager = llm.llm_engine.structured_output
    validate_ms, compile_ms = [], []
    for tag in range(1, num_schemas + 1):
        params = StructuredOutputsParams(json=inventory_schema(1000 + tag))
        start = time.perf_counter()
        manager.validate(params)
        validated = time.perf_counter()
        grammar = manager.grammar_for(params)
        while not grammar.is_ready():
            manager.wait_for_pending(0.001)
        validate_ms.append((validated - start) * 1e3)
        compile_ms.append((time.perf_counter() - validated) * 1e3)
    return {
        "validate_ms_mean": round(statistics.fmean(validate_ms), 2),
        "compile_ms_mean": round(statistics.fmean(compile_ms), 2),
        "compile_ms_max": round(max(compile_ms), 2),
    }


def run_structured_bench(ns: argparse.Namespace, args: EngineArgs) -> int:
    from octavo.entrypoints.llm import LLM

    if not 0.0 <= ns.structured_share <= 1.0:
        raise ValueError(f"--structured-share must be in [0, 1], got {ns.structured_share}.")
    llm = LLM.from_engine_args(args)
    engine = llm.llm_engine
    processor = engine.input_processor
    prompts = [
        processor.render_chat(
            [{"role": "user", "content": f"List the items in store {i} as JSON."}]
        )
        for i in range(ns.num_prompts)
    ]
    plain = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=ns.output_len,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=inventory_schema()),
    )
    num_structured = round(ns.num_prompts * ns.structured_share)
    mixed = [constrained] * num_structured + [plain] * (ns.num_prompts - num_structured)
    print("config:", engine.config.to_json())
    print(
        f"workload: {ns.num_prompts} chat prompts x {ns.output_len} output tokens, greedy, "
        f"ignore_eos; {num_structured} of them under a JSON schema in the mixed run"
    )

    # Warm-up: the tokenizer for the grammar library, the schema's compilation, the model.
    start = time.perf_counter()
    engine.structured_output.validate(constrained.structured_outputs)
    tokenizer_s = time.perf_counter() - start
    llm.generate(prompts[:2], [constrained, plain], use_tqdm=False)

    # Alternating runs, best of each: on a shared machine the slower runs measure the
    # neighbours, not the engine.
    runs: dict[str, list[dict[str, float]]] = {"unconstrained": [], "structured": []}
    for _ in range(max(ns.repeats, 1)):
        runs["unconstrained"].append(_run_batch(llm, prompts, [plain] * ns.num_prompts))
        runs["structured"].append(_run_batch(llm, prompts, mixed))
    unconstrained, structured = (
        max(runs[mode], key=lambda run: run["output_tokens_per_s"]) for mode in runs
    )
    compilation = _time_compilation(llm, ns.num_schemas)
    slowdown = unconstrained["output_tokens_per_s"] / structured["output_tokens_per_s"]
    result = {
        "num_prompts": ns.num_prompts,
        "output_len": ns.output_len,
        "num_structured": num_structured,
        "repeats": max(ns.repeats, 1),
        "unconstrained": unconstrained,
        "structured": structured,
        "throughput_ratio": round(1 / slowdown, 3),
        "grammar_tokenizer_build_s": round(tokenizer_s, 3),
        **compilation,
        "dtype": engine.config.dtype,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
    }
    print(
        f"unconstrained: {unconstrained['output_tokens_per_s']} output tok/s; "
        f"{num_structured}/{ns.num_prompts} structured: "
        f"{structured['output_tokens_per_s']} output tok/s "
        f"(x{result['throughput_ratio']}), mask fill {structured['bitmask_fill_s']} s"
    )
    print(
        f"new schema: validate {compilation['validate_ms_mean']} ms, compile "
        f"{compilation['compile_ms_mean']} ms mean ({compilation['compile_ms_max']} ms max)"
    )
    print(json.dumps(result))
    return 0
