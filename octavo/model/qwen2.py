"""Qwen2 (Qwen2, Qwen2.5): the Llama decoder with biases on the q, k and v projections.

HF's modeling_qwen2 differs from modeling_llama only there (and in an optional sliding window,
which ModelConfig turns into a context cap). ModelConfig.from_hf_config sets attention_bias=True
and attention_out_bias=False for this architecture, so the class adds nothing but its name.
"""

from __future__ import annotations

from octavo.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Checkpoint names, forward and compute_logits exactly as LlamaForCausalLM."""
