"""FusedDecodeLayer: a whole Llama-style decoder layer over decode rows as one kernel call.

At small batches the ~25 torch ops and Python calls around the kernels of each layer cost as
much as the work, so for a step whose rows are all single-token decodes each layer runs as one
`ops.decode_layer` call, which makes the same kernel calls in the same order as the layer's
Python code (same results). The kernel hard-codes that code's assumptions, so it is opt-in: an
architecture's ArchSpec must ask for it (`fused_decode_layer`), and `incompatibility(model)`
checks everything the kernel assumes of the layers as loaded; anything it does not recognise
keeps the model on its own forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model.arch import get_spec
from octavo.model.cpu import ops
from octavo.model.formats.base import ConcatWeight, LinearWeight
from octavo.model.formats.packed import PackedWeight
from octavo.model.formats.quantized import QuantizedWeight


class FusedDecodeLayers:
    """The bound kernel arguments of every layer of one model; called by the model's forward
    for an all-decode step of the CPU paged attention backend."""

    def __init__(
        self,
        layer_args: list[tuple],
        feed_forwards: list[nn.Module | None] | None = None,
        attentions: list[nn.Module] | None = None,
    ) -> None:
        self.layer_args = layer_args
        # Each layer's PagedAttention, for the KV cache group the runner gives it.
        self.attentions = attentions or [None] * len(layer_args)
        # Per layer, the feed-forward that runs after the kernel's call (a mixture of experts,
        # whose kernel arguments have no MLP parts), or None where the kernel runs the MLP.
        self.feed_forwards = feed_forwards or [None] * len(layer_args)

    def __call__(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor], plan
    ) -> tuple[Tensor, Tensor]:
        """hidden: (num_tokens, hidden) float32, the embeddings; plan: the step's PagedPlan.
        Returns (the last layer's output, the residual stream before it), as the model's own
        loop over its layers does."""
        # A zero residual makes the first layer's add a no-op (x + 0 == x), so its norm sees
        # what the unfused first layer's does.
        residual = torch.zeros_like(hidden)
        for args, kv_cache, feed_forward, attention in zip(
            self.layer_args, kv_caches, self.feed_forwards, self.attentions, strict=True
        ):
            window = args[-1]
            if plan.groups:  # KV cache groups: the layer's own, cut for its window
                layer_plan = plan.groups[attention.kv_group]
            else:
                layer_plan = plan.windows[window] if window else plan
            decode = layer_plan.decode
            hidden = ops.decode_layer(
                hidden,
                residual,
                args,
                cos,
                sin,
                kv_cache,
                layer_plan.metadata.slot_mapping,
                decode.block_table,
                decode.seq_lens,
            )
            if feed_forward is not None:
                hidden = feed_forward(hidden)
        return hidden, residual


def incompatibility(model: nn.Module) -> str | None:
    """Why the fused layer cannot run this loaded model, or None if it can: the architecture
    opted in, every layer is the Llama layer, SiLU, no soft-cap, float32 RMSNorms of one eps per
    layer, and every projection packed or
    in block kernel parts (kernel_parts).
    A mixture of experts in place of the MLP runs after the kernel's call (the attention
    half): as one moe_feed_forward call where its weights allow, else in its own forward."""
    from octavo.model.layers.mlp import GatedMLP
    from octavo.model.layers.moe import SparseMoE
    from octavo.model.llama import LlamaDecoderLayer

    config = model.config
    if not get_spec(config.architecture).fused_decode_layer:
        return f"{config.architecture} does not use it"
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}"
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return f"{type(layer).__name__} is not the Llama decoder layer"
        if not isinstance(layer.mlp, (GatedMLP, SparseMoE)):
            return f"{type(layer.mlp).__name__} in place of the gated MLP"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm and attn.q_norm.eps != layer.input_layernorm.eps:
            return "the q/k norms' eps differs from the layer's"
        if attn.attn.softcap:
            return "soft-capped attention"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.weight.dtype != torch.float32 for norm in norms):
            return "norm weights are not float32"
        if norms[0].eps != norms[1].eps:
            return "the layer's two norms differ in eps"
        for linear in (attn.qkv_proj, attn.o_proj, *_kernel_mlp(mlp)):
            if kernel_parts(linear.weight_format) is None:
                return f"a projection's weight format is {linear.weight_format.name}"
    return None


def _kernel_mlp(mlp: nn.Module) -> tuple[nn.Module, ...]:
    """The MLP's projections the kernel runs: a gated MLP's two, none of a mixture of
    experts (which runs after the kernel's call)."""
    from octavo.model.layers.moe import SparseMoE

    return () if isinstance(mlp, SparseMoE) else (mlp.gate_up_proj, mlp.down_proj)


class MoeFeedForward:
    """A mixture of experts as one ops.moe_feed_forward call, its weights bound."""

    def __init__(self, args: tuple) -> None:
        self.args = args

    def __call__(self, hidden: Tensor) -> Tensor:
        return ops.moe_feed_forward(hidden, self.args)


def _moe_kernel(mlp: nn.Module) -> MoeFeedForward | None:
    """The kernel call for a mixture of experts whose router and experts are all packed or in
    block kernel parts, with no shared expert; None where it must run its own forward."""
    if mlp.shared_expert is not None:
        return None
    linears = [mlp.gate]
    for expert in mlp.experts:
        linears += [expert.gate_up_proj, expert.down_proj]
    parts = [kernel_parts(linear.weight_format) for linear in linears]
    if any(p is None for p in parts):
        return None
    return MoeFeedForward((*_kernel_args(parts), mlp.top_k, mlp.renormalize))


def _kernel_args(parts: list[list[tuple]]) -> tuple:
    """Projections' kernel parts (kernel_parts each) as the kernels take them: (weights,
    kinds, rows, limits, tile limits, each projection's count, the dtype block weights are
    dequantized to above their limits)."""
    flat = [part for projection in parts for part in projection]
    gemm_dtypes = {part[5] for part in flat if part[5] is not None}
    if len(gemm_dtypes) > 1:
        raise ValueError(f"a layer's block weights dequantize to {sorted(map(str, gemm_dtypes))}")
    return (
        [part[0] for part in flat],
        [part[1] for part in flat],
        [part[2] for part in flat],
        [part[3] for part in flat],
        [part[4] for part in flat],
        [len(projection) for projection in parts],
        gemm_dtypes.pop() if gemm_dtypes else torch.float32,
    )


KernelPart = tuple[Tensor, int, int, int, int, torch.dtype | None]


def kernel_parts(fmt: LinearWeight) -> list[KernelPart] | None:
    """A projection's weight as the kernel's parts: (weight, kind, rows, limit, tile limit,
    gemm dtype) each, kind -1 for packed panels, which take up to `limit` rows (the format's
    max_rows), then the copy in AMX tile order where the format has one (kind -3, up to its
    tiles_max_rows), followed by the float weight (kind -2; its copy reordered for oneDNN where the
    format has one) that torch's GEMM takes above; or the block type id the block kernel
    reads, which takes up to `limit` rows (the format's max_rows), the AMX tiles up to `tile
    limit` (tiles_max_rows) and torch's GEMM on the blocks dequantized to the gemm dtype
    above; None where a part is neither (a float part, or blocks without the kernels)."""
    if isinstance(fmt, PackedWeight):
        n = fmt.weight.shape[0]
        gemm_weight = fmt.weight if fmt.onednn_weight is None else fmt.onednn_weight
        tiles = [] if fmt.tiles is None else [(fmt.tiles, -3, n, fmt.tiles_max_rows, 0, None)]
        return [
            (fmt.packed, -1, n, fmt.max_rows, 0, None),
            *tiles,
            (gemm_weight, -2, n, -1, 0, None),
        ]
    if isinstance(fmt, QuantizedWeight):
        if not fmt.kernels:
            return None
        return [
            (
                fmt.tensor.blocks,
                fmt.kernel_type,
                fmt.shape[0],
                fmt.max_rows,
                fmt.tiles_max_rows,
                fmt.gemm_dtype,
            )
        ]
    if isinstance(fmt, ConcatWeight):
        parts = [kernel_parts(part) for part in fmt.parts]
        if any(p is None or p[0][1] < 0 for p in parts):
            return None
        return [p[0] for p in parts]
    return None


def bind(model: nn.Module) -> FusedDecodeLayers:
    """The kernel arguments of every layer (weights are fixed once loaded). Call only when
    incompatibility(model) is None."""
    layer_args = []
    feed_forwards = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        kernel_mlp = _kernel_mlp(mlp)
        moe = None if kernel_mlp else _moe_kernel(mlp)
        feed_forwards.append(None if kernel_mlp else (moe or mlp))
        projections = (attn.qkv_proj, attn.o_proj, *kernel_mlp)
        parts = [kernel_parts(linear.weight_format) for linear in projections]
        parts += [[] for _ in range(4 - len(parts))]  # no MLP parts: the MLP runs after
        biases = [linear.bias for linear in projections] + [None] * (4 - len(projections))
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        qk_norm_kind = {"": 0, "head": 1, "full": 2}[attn.qk_norm]
        layer_args.append(
            (
                norms[0].weight,
                norms[1].weight,
                norms[0].eps,
                *_kernel_args(parts),
                *biases,
                *qk_norms,
                qk_norm_kind,
                layer.residual_multiplier,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.attn.backend.decode_bf16,
                attn.attn.scale,
                attn.attn.window,
            )
        )
    attentions = [layer.self_attn.attn for layer in model.model.layers]
    return FusedDecodeLayers(layer_args, feed_forwards, attentions)
