"""`python -m octavo.model.cpu --bench`: decode-sized matmuls, torch's GEMM against the
packed kernel, as a decode step meets them.

The weights are those of a whole decoder (`--layers` x q/k/v, o, gate/up, down of the given
sizes; the default is SmolLM2-135M's), each layer its own tensors, so that, as in a real step,
they stream from memory rather than sit in cache. For each row count: the time of one pass over
all of them with torch's float32 GEMM (`F.linear`) and with the packed kernel on bfloat16 and on
float32 panels (medians of `--repeats` passes), the best GFLOP/s, and the weight bytes per
second the bf16 panels stream. Ends with one JSON line.

With `--attention`, paged decode attention instead: for each number of sequences (`--seqs`, each
`--context-len` tokens) and each cache dtype, one pass over `--layers` layers' caches (blocks
of `--block-size` tokens, shuffled as in a pool after some traffic, in huge pages as the engine
allocates them), the kernel against the plain-torch reference (gather, then einsum and
softmax), and the K/V bytes per second the kernel reads; over a bfloat16 cache on a CPU with
AVX512-BF16, also the kernel's bfloat16 products (bf16_products), alternated with the float one.

With `--prefill`, paged prefill attention: for each prompt chunk length (`--prompt-lens`, after
`--prefix-len` cached tokens), one pass over `--layers` layers' float32 caches, the kernel
against what the backend does without it (SDPA, causal over the chunk's own keys, or over keys
gathered from the cache with a shifted causal mask after a prefix), and the GFLOP/s of the
causal work.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from octavo.model import memory
from octavo.model.cpu import build, ops, packing, reference
from octavo.model.cpu.calibration import time_interleaved


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument(
        "--rows",
        default="1,8,32,64,96,128",
        help="comma-separated numbers of rows (tokens) per matmul",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--attention",
        action="store_true",
        help="time paged decode attention instead of the matmuls",
    )
    parser.add_argument(
        "--seqs", default="1,8,32", help="with --attention: comma-separated numbers of sequences"
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=320,
        help="with --attention: tokens of context per sequence",
    )
    parser.add_argument(
        "--prefill", action="store_true", help="time paged prefill attention instead of the matmuls"
    )
    parser.add_argument(
        "--prompt-lens",
        default="256,512",
        help="with --prefill: comma-separated query tokens per chunk",
    )
    parser.add_argument(
        "--prefix-len", type=int, default=0, help="with --prefill: cached tokens before each chunk"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="with --attention or --prefill: tokens per KV block (the CPU default)",
    )


def _layer_shapes(ns: argparse.Namespace) -> list[tuple[int, int]]:
    """(out, in) of each matmul of one decoder layer, packed as octavo packs them."""
    head_dim = ns.hidden_size // ns.num_heads
    qkv = (ns.num_heads + 2 * ns.num_kv_heads) * head_dim
    return [
        (qkv, ns.hidden_size),
        (ns.num_heads * head_dim, ns.hidden_size),
        (2 * ns.intermediate_size, ns.hidden_size),
        (ns.hidden_size, ns.intermediate_size),
    ]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _interleaved_median_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Median ms of each named function, timed in turn (calibration.time_interleaved)."""
    times = time_interleaved(runs, repeats)
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()}


def run_attention_bench(ns: argparse.Namespace) -> int:
    head_dim, block_size = ns.hidden_size // ns.num_heads, ns.block_size
    blocks_per_seq = -(-ns.context_len // block_size)
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {ns.layers} layers, "
        f"{ns.num_heads} heads ({ns.num_kv_heads} kv) x {head_dim}, {ns.context_len} tokens "
        "per sequence"
    )
    results = []
    for seqs in [int(part) for part in ns.seqs.split(",") if part.strip()]:
        num_blocks = seqs * blocks_per_seq
        shape = (num_blocks, block_size, ns.num_kv_heads, head_dim)
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(seqs, -1)
        lens = torch.full((seqs,), ns.context_len, dtype=torch.int32)
        query = torch.randn(seqs, ns.num_heads, head_dim, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            caches = [
                tuple(
                    memory.empty(shape, dtype).copy_(torch.randn(shape, generator=gen))
                    for _ in range(2)
                )
                for _ in range(ns.layers)
            ]

            def run(fn, caches=caches, query=query, table=table, lens=lens) -> None:
                for key, value in caches:
                    fn(query, key, value, table, lens, head_dim**-0.5)

            # Over a bfloat16 cache, the float kernel alternated with the bfloat16 products
            # where the CPU has them (the engine's choice there).
            bf16 = dtype == torch.bfloat16 and ops.bf16_tiles_available()
            if bf16:
                timed = _interleaved_median_ms(
                    {
                        "float": lambda: run(ops.paged_decode_attention),
                        "bf16": lambda: run(
                            functools.partial(ops.paged_decode_attention, bf16_products=True)
                        ),
                    },
                    ns.repeats,
                )
                kernel_ms, products_ms = timed["float"], timed["bf16"]
            else:
                kernel_ms = _median_ms(lambda: run(ops.paged_decode_attention), ns.repeats)
            reference_ms = _median_ms(
                lambda: run(reference.paged_decode_attention_reference), max(ns.repeats // 2, 1)
            )
            read = 2 * ns.layers * seqs * ns.context_len * ns.num_kv_heads * head_dim
            row = {
                "seqs": seqs,
                "kv_dtype": str(dtype).removeprefix("torch."),
                "kernel_ms": round(kernel_ms, 2),
                "reference_ms": round(reference_ms, 2),
                "kernel_gb_s": round(read * dtype.itemsize / (kernel_ms * 1e-3) / 1e9, 1),
            }
            if bf16:
                row["bf16_products_ms"] = round(products_ms, 2)
            results.append(row)
            print(
                f"{seqs:4d} seqs, {row['kv_dtype']:8s} cache: kernel {kernel_ms:8.2f} ms, "
                f"reference {reference_ms:8.2f} ms; kernel reads {row['kernel_gb_s']:5.1f} "
                "GB/s" + (f"; bfloat16 products {products_ms:8.2f} ms" if bf16 else ""),
                flush=True,
            )
    print(json.dumps({"layers": ns.layers, "context_len": ns.context_len, "results": results}))
    return 0


def run_prefill_bench(ns: argparse.Namespace) -> int:
    head_dim, block_size, prefix = ns.hidden_size // ns.num_heads, ns.block_size, ns.prefix_len
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {ns.layers} layers, "
        f"{ns.num_heads} heads ({ns.num_kv_heads} kv) x {head_dim}, {prefix} cached tokens "
        "before each chunk"
    )
    results = []
    for q_len in [int(part) for part in ns.prompt_lens.split(",") if part.strip()]:
        seq_len = prefix + q_len
        num_blocks = -(-seq_len // block_size)
        shape = (num_blocks, block_size, ns.num_kv_heads, head_dim)
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(1, -1)
        caches = [
            (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(ns.layers)
        ]
        query = torch.randn(q_len, ns.num_heads, head_dim, generator=gen)
        out = torch.empty_like(query)
        lens = [torch.tensor([n], dtype=torch.int32) for n in (0, q_len, seq_len)]
        slots = (table[0].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
        slots = slots[:seq_len]
        # Without a prefix the backend attends over the step's own keys, not the cache's.
        own = [(key.flatten(0, 1)[slots], value.flatten(0, 1)[slots]) for key, value in caches]
        mask = None
        if prefix:
            mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(prefix, seq_len).unsqueeze(1)

        def kernel(caches=caches, out=out, query=query, table=table, lens=lens) -> None:
            for key, value in caches:
                ops.paged_prefill_attention(
                    out, query, key, value, table, *lens, scale=head_dim**-0.5
                )

        def sdpa(caches=caches, own=own, query=query, slots=slots, mask=mask) -> None:
            chunk_query = query.transpose(0, 1).unsqueeze(0)
            for (key, value), (own_key, own_value) in zip(caches, own):
                if prefix:
                    own_key = key.flatten(0, 1).index_select(0, slots)
                    own_value = value.flatten(0, 1).index_select(0, slots)
                F.scaled_dot_product_attention(
                    chunk_query,
                    own_key.transpose(0, 1).unsqueeze(0),
                    own_value.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=head_dim**-0.5,
                    enable_gqa=True,
                )

        times = _interleaved_median_ms({"kernel": kernel, "sdpa": sdpa}, ns.repeats)
        flops = 4 * ns.layers * q_len * ns.num_heads * head_dim * (prefix + (q_len + 1) / 2)
        row = {"prompt_len": q_len, "prefix_len": prefix}
        for name, ms in times.items():
            row[f"{name}_ms"] = ms
            row[f"{name}_gflops"] = round(flops / (ms * 1e-3) / 1e9, 1)
        results.append(row)
        print(
            f"{q_len:5d} tokens: kernel {row['kernel_ms']:8.2f} ms ({row['kernel_gflops']:5.1f} "
            f"GFLOP/s), SDPA {row['sdpa_ms']:8.2f} ms ({row['sdpa_gflops']:5.1f} GFLOP/s)",
            flush=True,
        )
    print(json.dumps({"layers": ns.layers, "results": results}))
    return 0


def run_bench(ns: argparse.Namespace) -> int:
    if not build.load():
        raise SystemExit("the CPU kernels are not available here (see the log above)")
    if ns.attention:
        return run_attention_bench(ns)
    if ns.prefill:
        return run_prefill_bench(ns)
    rows_list = [int(part) for part in ns.rows.split(",") if part.strip()]
    gen = torch.Generator().manual_seed(0)
    shapes = _layer_shapes(ns) * ns.layers
    # bf16-exact float32 weights: both panel kinds hold the same numbers.
    weights = [torch.randn(n, k, generator=gen).bfloat16().float() for n, k in shapes]
    # Panels in one huge-page allocation per kind, as the loader places them.
    panels_of = {}
    for allow_bf16 in (True, False):
        layouts = [packing.packed_layout(w, allow_bf16) for w in weights]
        panels_of[allow_bf16] = [
            packing.pack_linear_weight(w, out=slot)
            for w, slot in zip(weights, memory.empty_many(layouts))
        ]
    bf16_panels, fp32_panels = panels_of[True], panels_of[False]
    num_params = sum(n * k for n, k in shapes)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {ns.layers} layers, "
        f"{num_params / 1e6:.1f}M weights ({num_params * 4 / 2**20:.0f} MiB in float32)"
    )
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=gen) for _, k in shapes}

        def gemm(inputs=inputs) -> None:
            for (_, k), weight in zip(shapes, weights):
                F.linear(inputs[k], weight)

        def packed(panels: list[torch.Tensor], inputs=inputs) -> None:
            for (n, k), panel in zip(shapes, panels):
                ops.packed_linear(inputs[k], panel, n)

        runs = {
            "torch_fp32": gemm,
            "packed_bf16": lambda: packed(bf16_panels),
            "packed_fp32": lambda: packed(fp32_panels),
        }
        times = _interleaved_median_ms(runs, ns.repeats)
        row = {"rows": rows}
        for name, ms in times.items():
            row[f"{name}_ms"] = ms
        best = min(row[f"{name}_ms"] for name in times)
        row["best_gflops"] = round(2 * rows * num_params / (best * 1e-3) / 1e9, 1)
        row["packed_bf16_weight_gb_s"] = round(
            2 * num_params / (row["packed_bf16_ms"] * 1e-3) / 1e9, 1
        )
        results.append(row)
        print(
            f"{rows:4d} rows: torch fp32 {row['torch_fp32_ms']:8.2f} ms, packed bf16 "
            f"{row['packed_bf16_ms']:8.2f} ms, packed fp32 {row['packed_fp32_ms']:8.2f} ms; "
            f"best {row['best_gflops']:6.1f} GFLOP/s, bf16 panels stream "
            f"{row['packed_bf16_weight_gb_s']:5.1f} GB/s",
            flush=True,
        )
    print(json.dumps({"layers": ns.layers, "num_params": num_params, "results": results}))
    return 0
