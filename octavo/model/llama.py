"""Llama decoder (SmolLM2, Llama 2/3, Mistral-style), reading like HF's modeling_llama.

Attention / MLP / DecoderLayer / Model / ForCausalLM in that order, over a flat batch: inputs are
(num_tokens,) ids and positions of all scheduled requests with no padding, attention goes through
the paged cache. The Qwen2 and Qwen3 variants are this decoder with the differences ModelConfig
spells out (q/k/v bias, per-head q/k norms, head_dim), so they share it. Module and parameter
names follow the HF checkpoint except for the packed `qkv_proj` / `gate_up_proj`
(see `packed_modules_mapping`). Knows nothing of requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from octavo.model import kernels
from octavo.model.attention.layer import PagedAttention
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.config import ModelConfig
from octavo.model.layers.embedding import VocabEmbedding
from octavo.model.layers.linear import Linear, PackedLinear, linear
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, apply_rotary_
from octavo.model.layers.weights import load_checkpoint_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE.
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self.qkv_proj.split_output(qkv)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        else:
            # q's and k's heads are adjacent in each qkv row: one rotary call for both, in
            # place where the fused kernel runs (a view into this layer's fresh qkv output).
            qk = qkv[:, : q.shape[1] + k.shape[1]].view(num_tokens, -1, self.head_dim)
            q, k = apply_rotary_(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata)  # (num_tokens, q_size)
        return self.o_proj(attn_output)


class LlamaMLP(GatedMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        attn_metadata: AttentionMetadata,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns (this layer's output, residual stream before it): the residual add is left
        to the next norm, which fuses it (the first layer gets residual=None). With `rows`
        (int64 token indices), the attention still runs on every token and caches its keys
        and values, but the MLP and both outputs only cover those rows, in that order."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_metadata)
        if rows is not None:
            hidden_states, residual = hidden_states[rows], residual[rows]
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual

    def decode_kernel_args(self) -> tuple | None:
        """This layer's weights and sizes as kernels.decode_layer takes them, or None where that
        kernel cannot run it (weights without a packed copy, Qwen3's per-head q/k norms)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if (
            attn.qk_norm
            or any(linear.packed_weight is None for linear in linears)
            or any(norm.weight.dtype != torch.float32 for norm in norms)
            or norms[0].eps != norms[1].eps
        ):
            return None
        return (
            norms[0].weight,
            norms[1].weight,
            norms[0].eps,
            attn.qkv_proj.packed_weight,
            attn.qkv_proj.bias,
            attn.o_proj.packed_weight,
            attn.o_proj.bias,
            mlp.gate_up_proj.packed_weight,
            mlp.gate_up_proj.bias,
            mlp.down_proj.packed_weight,
            mlp.down_proj.bias,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            mlp.down_proj.in_features,
            attn.attn.scale,
        )


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Every layer's decode_kernel_args, gathered on the first forward (weights are fixed
        # once loaded); None if some layer cannot use the kernel.
        self._decode_layer_args: list[tuple] | None = None
        self._decode_layer_args_known = False

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: Tensor | None = None,
    ) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        # One cos/sin for all layers: (num_tokens, head_dim) each.
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)
        if self._use_decode_kernel(hidden_states, attn_metadata):
            # Each layer as one kernel call. A zero residual makes the first layer's add a
            # no-op (x + 0 == x), so its norm sees what the unfused first layer's does.
            decode = attn_metadata.decode
            residual = torch.zeros_like(hidden_states)
            for args, kv_cache in zip(self._decode_layer_args, kv_caches, strict=True):
                hidden_states = kernels.decode_layer(
                    hidden_states,
                    residual,
                    args,
                    cos,
                    sin,
                    kv_cache,
                    attn_metadata.slot_mapping,
                    decode.block_table,
                    decode.seq_lens,
                )
            if output_rows is not None:
                hidden_states, residual = hidden_states[output_rows], residual[output_rows]
        else:
            # Only the rows asked for leave the last layer: the other tokens' last MLP feeds
            # nothing (their keys and values, which later tokens read, are cached by then).
            residual = None
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                hidden_states, residual = layer(
                    hidden_states,
                    residual,
                    cos,
                    sin,
                    kv_cache,
                    attn_metadata,
                    output_rows if i == last else None,
                )
        hidden_states, _ = self.norm.add_and_norm(hidden_states, residual)
        return hidden_states

    def _use_decode_kernel(self, hidden_states: Tensor, attn_metadata: AttentionMetadata) -> bool:
        """Whether this forward can run each layer as one kernels.decode_layer call: every row
        a decode attended by the paged kernel, float32 on a CPU, and every layer supported."""
        decode = attn_metadata.decode
        if (
            decode is None
            or decode.token_idx is not None  # some rows are prompt chunks
            or decode.block_table is None  # attention planned without the paged kernel
            or attn_metadata.backend != "sdpa"
            or not kernels.use_fused_elementwise(hidden_states)
        ):
            return False
        if not self._decode_layer_args_known:
            args = [layer.decode_kernel_args() for layer in self.layers]
            self._decode_layer_args = None if None in args else args
            self._decode_layer_args_known = True
        return self._decode_layer_args is not None


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection -> (packed module, shard): q/k/v and gate/up run as one matmul each.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied checkpoints have no lm_head: logits reuse the embedding matrix, so there is no
        # second parameter to keep in sync (or to lose the sharing of when materialising).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions: (num_tokens,) int64, all scheduled tokens of all requests, flat,
        no padding; kv_caches: one tensor per layer (see kv_cache.py), written at
        attn_metadata.slot_mapping. Returns hidden states (num_tokens, hidden_size), or with
        `output_rows` ((n,) int64 token indices, e.g. the rows to sample) only those rows,
        (n, hidden_size), which spares the last layer's MLP for the others."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, output_rows)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """(n, hidden) -> (n, vocab_size) float32. Call it only on the rows that are sampled."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden_states, head.weight, None, head.packed_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model. Raises ValueError naming an
        unexpected tensor, a shape mismatch, or the missing ones."""
        ignored = frozenset({"lm_head.weight"}) if self.lm_head is None else frozenset()
        with torch.no_grad():
            load_checkpoint_weights(self, weights, self.packed_modules_mapping, ignored)
