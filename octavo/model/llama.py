"""The Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3, and with experts in
place of the MLP Mixtral, Qwen2-MoE and Qwen3-MoE), reading like HF's modeling_llama.

Attention / MLP / DecoderLayer / Model / ForCausalLM in that order, over a flat batch: inputs are
(num_tokens,) ids and positions of all scheduled requests with no padding, attention goes through
the paged cache. Qwen2 and Qwen3 are this decoder with the differences their ArchSpec makes in
ModelConfig (q/k/v biases, per-head q/k norms, head_dim), so they share the class. Module and
parameter names follow the HF checkpoint except for the packed `qkv_proj` / `gate_up_proj`
(see `packed_modules_mapping`). Every op comes from the backend the model is built with.
Knows nothing of requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import Tensor, nn

from octavo.model.attention.layer import PagedAttention
from octavo.model.backends import ModelBackend
from octavo.model.backends.base import AttentionPlan, LayerOps
from octavo.model.config import ModelConfig
from octavo.model.layers.embedding import VocabEmbedding
from octavo.model.layers.linear import Linear, PackedLinear
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.moe import SparseMoE
from octavo.model.layers.norm import HeadRMSNorm, RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.layers.weights import load_checkpoint_weights
from octavo.model.parallel import TRIVIAL, TPGroup


class LlamaAttention(nn.Module):
    # The ranks its heads are split over (model/parallel.py); o_proj's outputs are summed.
    tp: TPGroup = TRIVIAL

    def __init__(self, config: ModelConfig, backend: ModelBackend, layer: int = 0) -> None:
        """`layer`: this layer's index (its sliding window, if it has one)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.ops = backend.ops
        self.qkv_proj = PackedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm == "head":
            # Qwen3, Gemma 3: RMSNorm over head_dim on every q and k head, before RoPE.
            self.q_norm = HeadRMSNorm(config.head_dim, config.rms_norm_eps, backend.ops)
            self.k_norm = HeadRMSNorm(config.head_dim, config.rms_norm_eps, backend.ops)
        elif self.qk_norm == "full":
            # OLMo 2, OLMoE: RMSNorm over the whole q and k projections, before RoPE.
            self.q_norm = RMSNorm(config.q_size, config.rms_norm_eps, backend.ops)
            self.k_norm = RMSNorm(config.kv_size, config.rms_norm_eps, backend.ops)
        scale = config.attention_scale
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5 if scale is None else scale,
            backend=backend.attention,
            window=config.layer_window(layer),
            softcap=config.attn_logit_softcapping,
        )

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        attn_plan: AttentionPlan,
    ) -> Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self.qkv_proj.split_output(qkv)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            if self.qk_norm == "head":
                q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
                k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            else:
                q = self.q_norm(q).view(num_tokens, self.num_heads, self.head_dim)
                k = self.k_norm(k).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        else:
            # q's and k's heads are adjacent in each qkv row: one rotary call for both, in
            # place where the backend's op rotates in place (a view into this layer's fresh
            # qkv output).
            qk = qkv[:, : q.shape[1] + k.shape[1]].view(num_tokens, -1, self.head_dim)
            q, k = self.ops.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        attn_output = self.attn(q, k, v, kv_cache, attn_plan)  # (num_tokens, q_size)
        return self.tp.all_reduce(self.o_proj(attn_output))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: ModelBackend, layer: int = 0) -> None:
        """`layer`: this layer's index (mixture-of-experts models keep some layers dense)."""
        super().__init__()
        ops = backend.ops
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = make_mlp(config, ops, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # Granite scales each sublayer's output before its residual add.
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self,
        hidden_states: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        attn_plan: AttentionPlan,
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
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_plan)
        if rows is not None:
            hidden_states, residual = hidden_states[rows], residual[rows]
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual
        )
        hidden_states = self.mlp(hidden_states)
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        return hidden_states, residual


def make_mlp(config: ModelConfig, ops: LayerOps, layer: int) -> GatedMLP | SparseMoE:
    """Decoder layer `layer`'s feed-forward: the experts where it has them, else the gated MLP."""
    if config.is_moe_layer(layer):
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.hidden_act,
            ops,
            config.shared_expert_intermediate_size,
        )
    return GatedMLP(
        config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, ops
    )


class LlamaModel(nn.Module):
    # The decoder layer class, (config, backend, layer index) -> module; a family whose layer
    # differs (Gemma's four norms) names its own.
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, backend: ModelBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # Sliding layers with a RoPE of their own (Gemma 3's local base) get its cos/sin.
        self.local_rotary_emb = None
        self.local_layers = frozenset(config.sliding_layers if config.local_rope else ())
        if config.local_rope is not None:
            self.local_rotary_emb = RotaryEmbedding(config.head_dim, *config.local_rope)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        # Every layer as one kernel call for all-decode steps, bound by the backend once the
        # weights are loaded where it is compatible (model/cpu/fused.py); None: the layers'
        # own forward always.
        self.fused_decode = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_plan: AttentionPlan,
        output_rows: Tensor | None = None,
    ) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * self.embedding_multiplier
        # One cos/sin for all layers: (num_tokens, head_dim) each (and one for local layers).
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)
        local = cos, sin
        if self.local_rotary_emb is not None:
            local = self.local_rotary_emb(positions, hidden_states.dtype)
        if self.fused_decode is not None and attn_plan.metadata.is_all_decode:
            hidden_states, residual = self.fused_decode(
                hidden_states, cos, sin, kv_caches, attn_plan
            )
            if output_rows is not None:
                hidden_states, residual = hidden_states[output_rows], residual[output_rows]
        else:
            # Only the rows asked for leave the last layer: the other tokens' last MLP feeds
            # nothing (their keys and values, which later tokens read, are cached by then).
            residual = None
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                layer_cos, layer_sin = local if i in self.local_layers else (cos, sin)
                hidden_states, residual = layer(
                    hidden_states,
                    residual,
                    layer_cos,
                    layer_sin,
                    kv_cache,
                    attn_plan,
                    output_rows if i == last else None,
                )
        hidden_states, _ = self.norm.add_and_norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # The decoder stack's class (a family with its own layer names its own).
    model_class: ClassVar[type[nn.Module]] = LlamaModel
    # The ranks the model is split over: lm_head holds this rank's share of the vocabulary.
    tp: TPGroup = TRIVIAL
    # Checkpoint projection -> (packed module, shard): q/k/v and gate/up run as one matmul each.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig, backend: ModelBackend) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, backend)
        self.logits_scaling = config.logits_scaling
        self.final_logit_softcapping = config.final_logit_softcapping
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
        attn_plan: AttentionPlan,
        output_rows: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions: (num_tokens,) int64, all scheduled tokens of all requests, flat,
        no padding; kv_caches: one tensor per layer (see kv_cache.py), written at the plan's
        slot_mapping; attn_plan: the attention backend's plan of this step's metadata. Returns
        hidden states (num_tokens, hidden_size), or with `output_rows` ((n,) int64 token
        indices, e.g. the rows to sample) only those rows, (n, hidden_size), which spares the
        last layer's MLP for the others."""
        return self.model(input_ids, positions, kv_caches, attn_plan, output_rows)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """(n, hidden) -> (n, vocab_size) float32. Call it only on the rows that are sampled."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.head_format.matmul(hidden_states, None).float()
        else:
            logits = self.tp.all_gather(self.lm_head(hidden_states).float())
        if self.logits_scaling != 1.0:  # Granite
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping:  # Gemma 2
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model. Raises ValueError naming an
        unexpected tensor, a shape mismatch, or the missing ones."""
        ignored = frozenset({"lm_head.weight"}) if self.lm_head is None else frozenset()
        with torch.no_grad():
            load_checkpoint_weights(self, weights, self.packed_modules_mapping, ignored)
