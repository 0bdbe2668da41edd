"""Qwen3 (dense): the Llama decoder with an RMSNorm on every q and k head before RoPE.

HF's modeling_qwen3 also takes head_dim from the config (it need not be hidden / heads, e.g.
128 with 16 heads of a 1024-wide model) and names the norms self_attn.q_norm / k_norm; both are
carried by ModelConfig (head_dim, qk_norm=True) and built by LlamaAttention, so the class adds
nothing but its name. Sliding-window layers are turned into a context cap by ModelConfig.
"""

from __future__ import annotations

from octavo.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Checkpoint names, forward and compute_logits exactly as LlamaForCausalLM, plus the
    per-layer self_attn.q_norm.weight and self_attn.k_norm.weight."""
