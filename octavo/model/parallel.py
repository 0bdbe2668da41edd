"""Tensor parallelism: a model's heads, MLP columns and vocabulary split over the ranks of a
TPGroup, each rank holding its share of every weight in that weight's own format.

Megatron's split, as vLLM's parallel layers make it:

    qkv_proj, gate_up_proj   column-parallel: each rank the rows of its heads / MLP columns
    o_proj, down_proj        row-parallel: each rank the input columns it holds; the outputs
                             are summed over the ranks (one all-reduce per attention and per
                             MLP block), the bias added once
    lm_head                  vocabulary-parallel: each rank its share of the vocabulary's rows,
                             the logits gathered (a tied model's head is cut from the table)
    embed_tokens             replicated: every rank looks up whole rows

KV heads are split with the query heads, so each rank's KV cache holds its heads of every
token. `shard_model` cuts a loaded model in place, before the backend gives its Linears their
formats: a float weight is sliced, GGML blocks are sliced by rows, or by columns at block
boundaries. The forward then only differs by `tp.all_reduce` / `tp.all_gather`, which are
no-ops for the trivial group (TP=1 runs the same code).

What does not split yet is refused by `incompatibility` with the reason: head counts, MLP
width or vocabulary not divisible by the ranks, experts (MoE), norms over the whole q / k.
Knows nothing of processes: the group's ranks are joined by the executor (worker/executor.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from octavo.model.config import ModelConfig
from octavo.model.formats.ggml import BLOCK_TYPES, QuantizedTensor, row_bytes
from octavo.model.layers.linear import Linear, PackedLinear


class TPGroup:
    """The ranks a model is split over; `size` 1 is the trivial group (no communication)."""

    def __init__(self, rank: int = 0, size: int = 1, group: object | None = None) -> None:
        self.rank = rank
        self.size = size
        self.group = group

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's `x`, on every rank (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


TRIVIAL = TPGroup()


def incompatibility(config: ModelConfig, size: int) -> str | None:
    """Why `config`'s model cannot be split over `size` ranks; None if it can."""
    if size == 1:
        return None
    for what, count in (
        ("attention heads", config.num_attention_heads),
        ("key-value heads", config.num_key_value_heads),
        ("MLP columns (intermediate_size)", config.intermediate_size),
        ("vocabulary entries", config.vocab_size),
    ):
        if count % size:
            return f"its {count} {what} do not split evenly over {size} ranks"
    if config.num_experts:
        return "mixture-of-experts layers are not split across ranks yet"
    if not config.is_causal:
        return "an encoder (BERT) is not split across ranks yet"
    if config.qk_norm == "full":
        return "a norm over the whole q and k projections needs their every head on one rank"
    return None


def rank_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config as one rank's layers see it: its share of the heads (its KV cache's)."""
    if size == 1:
        return config
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
    )


def shard_model(model: nn.Module, tp: TPGroup) -> None:
    """Cut a loaded Llama-family model (llama.py's layers) down to rank `tp.rank`'s share, in
    place. Raises ValueError for a model `incompatibility` refuses or a GGML tensor whose
    columns do not split at block boundaries."""
    from octavo.model.layers.mlp import GatedMLP
    from octavo.model.llama import LlamaAttention

    config: ModelConfig = model.config
    reason = incompatibility(config, tp.size)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={tp.size}: {reason}.")
    rank, size = tp.rank, tp.size
    for name, module in model.named_modules():
        if isinstance(module, LlamaAttention):
            heads = {"q": module.num_heads, "k": module.num_kv_heads, "v": module.num_kv_heads}
            _split_rows(module.qkv_proj, {s: n * module.head_dim for s, n in heads.items()}, tp)
            _split_columns(module.o_proj, f"{name}.o_proj", tp)
            module.num_heads //= size
            module.num_kv_heads //= size
            module.attn.num_heads //= size
            module.attn.num_kv_heads //= size
            module.tp = tp
        elif isinstance(module, GatedMLP):
            sizes = dict(module.gate_up_proj.shard_sizes)
            _split_rows(module.gate_up_proj, sizes, tp)
            _split_columns(module.down_proj, f"{name}.down_proj", tp)
            module.tp = tp
    embed = model.model.embed_tokens
    vocab = config.vocab_size // size
    head = model.lm_head
    if head is None:  # tied: the head is this rank's rows of the table
        head = Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        if embed.quantized is not None:
            head.quantized = embed.quantized
        else:
            head.weight = nn.Parameter(embed.weight.data, requires_grad=False)
        model.lm_head = head
    _take_rows(head, rank * vocab, (rank + 1) * vocab)
    model.tp = tp


def _split_rows(linear: PackedLinear, shard_sizes: dict[str, int], tp: TPGroup) -> None:
    """Column-parallel: keep this rank's part of each shard's rows."""
    rows = []
    new_sizes = {}
    for shard, size in shard_sizes.items():
        part = size // tp.size
        begin = linear.shard_offsets[shard] + tp.rank * part
        rows.append((begin, begin + part))
        new_sizes[shard] = part
    index = torch.cat([torch.arange(b, e) for b, e in rows])
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight.data[index].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data[index].clone(), requires_grad=False)
    for shard, blocks in list(linear.quantized_shards.items()):
        part = shard_sizes[shard] // tp.size
        linear.quantized_shards[shard] = _block_rows(blocks, tp.rank * part, (tp.rank + 1) * part)
    if linear.quantized is not None:
        raise ValueError("a packed projection held as one GGML tensor is not split")
    linear.shard_sizes = new_sizes
    offset = 0
    for shard, size in new_sizes.items():
        linear.shard_offsets[shard] = offset
        offset += size
    linear.out_features = offset


def _split_columns(linear: Linear, name: str, tp: TPGroup) -> None:
    """Row-parallel: keep this rank's input columns; the bias stays on rank 0 only (the
    outputs are summed)."""
    part = linear.in_features // tp.size
    begin, end = tp.rank * part, (tp.rank + 1) * part
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight.data[:, begin:end].clone(), requires_grad=False)
        if linear.bias is not None and tp.rank != 0:
            linear.bias = None
    if linear.quantized is not None:
        linear.quantized = _block_columns(linear.quantized, begin, end, name)
    linear.in_features = part


def _take_rows(linear: Linear, begin: int, end: int) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight.data[begin:end].clone(), requires_grad=False)
    if linear.quantized is not None:
        linear.quantized = _block_rows(linear.quantized, begin, end)
    linear.out_features = end - begin


def _block_rows(tensor: QuantizedTensor, begin: int, end: int) -> QuantizedTensor:
    return QuantizedTensor(
        tensor.blocks[begin:end].clone(), tensor.qtype, (end - begin, tensor.shape[1])
    )


def _block_columns(tensor: QuantizedTensor, begin: int, end: int, name: str) -> QuantizedTensor:
    block = BLOCK_TYPES[tensor.qtype].block_size
    if begin % block or end % block:
        raise ValueError(
            f"{name}: its {tensor.qtype.name} blocks of {block} columns do not split at "
            f"columns {begin}-{end}; choose a tensor_parallel_size that divides "
            f"{tensor.shape[1] // block} blocks."
        )
    start, stop = row_bytes(tensor.qtype, begin), row_bytes(tensor.qtype, end)
    return QuantizedTensor(
        tensor.blocks[:, start:stop].clone(), tensor.qtype, (tensor.shape[0], end - begin)
    )
