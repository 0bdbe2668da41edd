"""Write a random-weight Llama of about 1.5B parameters as a bfloat16 GGUF, for measuring how
cost grows with model size (benchmarks/compare.sh --model FILE, and --weights Q4_K_M for the
quantized file llama-quantize makes of it).

The tokenizer, chat template and special tokens are the embedded model's (SmolLM2), so every
server tokenizes as with it; the shape is hidden 2048, 24 layers, intermediate 8192, 32 query and
8 key/value heads of 64: 1.54B parameters. Weights are N(0, 0.02) (norms 1): the text is noise,
the work per token is that of a real model of this shape.

    .venv/bin/python benchmarks/random_llama.py OUT.gguf [--layers 24 --hidden 2048 ...]

With --experts N the MLP of every layer is N experts of --intermediate, --experts-used of them
per token, written as llama.cpp writes Mixtral ("llama" with an expert count, the router as
ffn_gate_inp, each expert stack as one 3-D ffn_*_exps tensor), so that octavo and llama.cpp
serve the same mixture-of-experts file. --arch qwen3 writes Qwen3's layout instead (per-head
q/k norms; with --experts, "qwen3moe", renormalised top-k).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from octavo.model.convert import copy_gguf_metadata
from octavo.model.loader import find_default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--experts-used", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    ns = parser.parse_args(argv)
    source = GGUFReader(find_default_model())
    arch = ns.arch if ns.arch == "llama" or not ns.experts else "qwen3moe"
    writer = GGUFWriter(str(ns.out), arch)
    copy_gguf_metadata(source, writer, skip_prefixes=("llama.",))
    vocab = len(source.get_field("tokenizer.ggml.tokens").data)
    head_dim = ns.hidden // ns.heads
    writer.add_file_type(LlamaFileType.MOSTLY_BF16)
    writer.add_block_count(ns.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(ns.hidden)
    writer.add_feed_forward_length(ns.intermediate)
    writer.add_head_count(ns.heads)
    writer.add_head_count_kv(ns.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if ns.experts:
        writer.add_expert_count(ns.experts)
        writer.add_expert_used_count(ns.experts_used)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(ns.intermediate)
            writer.add_expert_weights_norm(True)
    if ns.arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rng = np.random.default_rng(ns.seed)
    count = 0

    def matrix(name: str, rows: int, cols: int, stack: int = 0) -> None:
        """A (rows, cols) matrix, or with `stack` a (stack, rows, cols) stack of them."""
        nonlocal count
        shape = (stack, rows, cols) if stack else (rows, cols)
        values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        writer.add_tensor(
            name, quantize(values, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16
        )
        count += values.size

    def vector(name: str, size: int) -> None:
        nonlocal count
        writer.add_tensor(name, np.ones(size, dtype=np.float32))
        count += size

    kv = ns.kv_heads * head_dim
    matrix("token_embd.weight", vocab, ns.hidden)
    for i in range(ns.layers):
        vector(f"blk.{i}.attn_norm.weight", ns.hidden)
        matrix(f"blk.{i}.attn_q.weight", ns.hidden, ns.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, ns.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, ns.hidden)
        matrix(f"blk.{i}.attn_output.weight", ns.hidden, ns.hidden)
        if ns.arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", head_dim)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim)
        vector(f"blk.{i}.ffn_norm.weight", ns.hidden)
        if ns.experts:
            matrix(f"blk.{i}.ffn_gate_inp.weight", ns.experts, ns.hidden)
            matrix(f"blk.{i}.ffn_gate_exps.weight", ns.intermediate, ns.hidden, ns.experts)
            matrix(f"blk.{i}.ffn_up_exps.weight", ns.intermediate, ns.hidden, ns.experts)
            matrix(f"blk.{i}.ffn_down_exps.weight", ns.hidden, ns.intermediate, ns.experts)
            continue
        matrix(f"blk.{i}.ffn_gate.weight", ns.intermediate, ns.hidden)
        matrix(f"blk.{i}.ffn_up.weight", ns.intermediate, ns.hidden)
        matrix(f"blk.{i}.ffn_down.weight", ns.hidden, ns.intermediate)
    vector("output_norm.weight", ns.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{ns.out}: {count / 1e9:.2f}B parameters (tied embeddings)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
