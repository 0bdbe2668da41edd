"""`octavo bench machine`: this machine's limits, against which engine numbers are read.

Measures, with the torch build octavo runs on: matmul throughput (GFLOP/s) in float32 and
bfloat16 at the shapes a decoder layer uses (a few rows for decode, many for prefill), and
memory bandwidth (a large copy, so caches do not help). From those and a model's size it
derives two ceilings:
- single-stream decode: every step reads all weights once, so tokens/s <= bandwidth / bytes;
- large batches: every token costs about 2 x parameters FLOPs, so tokens/s <= GFLOP/s / that.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument(
        "--num-params",
        type=float,
        default=134.5e6,
        help="model parameters, for the ceilings (default: SmolLM2-135M)",
    )
    parser.add_argument(
        "--num-embedding-params",
        type=float,
        default=28.3e6,
        help="embedding parameters, only read for sampled tokens",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")


def _time_per_call(fn, seconds: float) -> float:
    fn()  # warm-up: first calls pay for allocation and kernel selection
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def matmul_gflops(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype, seconds: float
) -> float:
    x = torch.randn(rows, in_features, dtype=dtype)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    per_call = _time_per_call(lambda: torch.nn.functional.linear(x, weight), seconds)
    return 2 * rows * in_features * out_features / per_call / 1e9


def copy_bandwidth_gb_s(num_bytes: int, seconds: float) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    per_call = _time_per_call(lambda: dst.copy_(src), seconds)
    # A copy reads and writes every byte.
    return 2 * num_bytes / per_call / 1e9


def run_machine(ns: argparse.Namespace) -> int:
    result: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows in (1, 32, 512):
            gflops = matmul_gflops(rows, ns.hidden_size, ns.intermediate_size, dtype, ns.seconds)
            result[f"{name}_gflops_rows{rows}"] = round(gflops, 1)
            print(
                f"matmul {name:8s} {rows:4d} x {ns.hidden_size} -> {ns.intermediate_size}: "
                f"{gflops:7.1f} GFLOP/s"
            )
    bandwidth = copy_bandwidth_gb_s(512 << 20, ns.seconds)
    result["copy_bandwidth_gb_s"] = round(bandwidth, 1)
    print(f"memory bandwidth (512 MiB copy): {bandwidth:.1f} GB/s")

    decoder_params = ns.num_params - ns.num_embedding_params
    for name, bytes_per_param in (("float32", 4), ("bfloat16", 2)):
        # Batch 1: the decoder weights plus the logits matrix are read once per token.
        ceiling = bandwidth * 1e9 / (ns.num_params * bytes_per_param)
        result[f"{name}_batch1_tokens_per_s_ceiling"] = round(ceiling, 1)
        gflops = float(result[f"{name}_gflops_rows512"])
        # Large batches: prompt tokens cost 2 x decoder params; logits only where sampled.
        large = gflops * 1e9 / (2 * decoder_params)
        result[f"{name}_large_batch_tokens_per_s_ceiling"] = round(large, 1)
        print(
            f"{name}: batch-1 decode <= {ceiling:.1f} tok/s (bandwidth); "
            f"large batch <= {large:.1f} tok/s (compute)"
        )
    print(json.dumps(result))
    return 0
