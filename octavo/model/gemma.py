"""Gemma 2 / Gemma 3 (text), and OLMo 2: decoders whose norms sit after each sublayer.

The attention, MLP, RoPE and the stack are the Llama family's (model/llama.py), with what
ModelConfig resolves for these families: sliding-window layers, attention and final-logit
soft-capping, `query_pre_attn_scalar`, embeddings scaled by sqrt(hidden_size), the tanh GELU,
Gemma 3's per-head q/k norms and local RoPE base, OLMo 2's q/k norms over whole projections.
What differs is the layer: each sublayer's output is normalised before its residual add
(post_attention_layernorm, post_feedforward_layernorm), and Gemma normalises each input too
(input_layernorm, pre_feedforward_layernorm), OLMo 2 not. Gemma's RMSNorm multiplies by
(1 + weight): its checkpoints store the offset-free weight, and loading adds the one, so the
shared norm runs unchanged (exact in float32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from torch import Tensor, nn

from octavo.model.backends import ModelBackend
from octavo.model.backends.base import AttentionPlan
from octavo.model.config import ModelConfig
from octavo.model.layers.norm import RMSNorm
from octavo.model.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, make_mlp


class SandwichDecoderLayer(nn.Module):
    # Whether each sublayer's input is normalised as well (Gemma), or only its output (OLMo 2).
    pre_norms: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, backend: ModelBackend, layer: int = 0) -> None:
        super().__init__()
        ops = backend.ops
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = make_mlp(config, ops, layer)
        if self.pre_norms:
            self.input_layernorm = RMSNorm(hidden, eps, ops)
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops)

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
        """LlamaDecoderLayer's contract: (output, residual stream before it), the residual add
        left to the next layer (residual=None for the first); `rows` as there."""
        if residual is not None:
            hidden_states, residual = self._add(hidden_states, residual, "input_layernorm")
        elif self.pre_norms:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            residual = hidden_states
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_plan)
        if rows is not None:
            hidden_states, residual = hidden_states[rows], residual[rows]
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self._add(hidden_states, residual, "pre_feedforward_layernorm")
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual

    def _add(self, x: Tensor, residual: Tensor, norm: str) -> tuple[Tensor, Tensor]:
        """(the next sublayer's input, x + residual): normalised by `norm` with pre-norms."""
        if self.pre_norms:
            return getattr(self, norm).add_and_norm(x, residual)
        residual = x + residual
        return residual, residual


class GemmaModel(LlamaModel):
    decoder_layer = SandwichDecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3's text decoder (Gemma3ForCausalLM)."""

    model_class = GemmaModel

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """LlamaForCausalLM's, with one added to every norm weight (Gemma's x * (1 + w))."""
        super().load_weights(
            (name, _offset_norm(tensor) if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )


def _offset_norm(weight: Tensor) -> Tensor:
    # In float32, as transformers computes 1 + w before casting back.
    return (1.0 + weight.float()).to(weight.dtype)


class Olmo2DecoderLayer(SandwichDecoderLayer):
    pre_norms = False


class Olmo2Model(LlamaModel):
    decoder_layer = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
