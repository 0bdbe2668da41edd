"""Which block type each matrix of a float checkpoint is quantized to: --quantization at load
and `octavo convert --outtype` share this plan.

A plan is one block type for every matrix (q8_0 ... q4_0, q6_k, q5_k, q4_k) or one of
llama-quantize's mixes (q4_k_m, q5_k_m: formats.ggml.mix_type). A matrix whose rows are not
whole blocks of its type takes the K-quant's fallback (ggml.K_FALLBACK) or stays float; vectors
(norms, biases) stay float. Tensor roles are read from Hugging Face names and GGUF names alike.
"""

from __future__ import annotations

import re

from octavo.model.arch import LLAMA_GGUF_GLOBAL_NAMES, LLAMA_GGUF_LAYER_NAMES
from octavo.model.formats.ggml import MIXES, GGMLType, mix_type, quantized_type

# The plans' names: each single block type, then the mixes.
PLANS = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", *MIXES)

# GGUF's names of the Llama family's tensors (arch.py), read back: a layer module's Hugging
# Face name (its last part) -> its GGUF role, and either name of a tensor outside the layers.
_HF_LAYER_ROLES = {hf.rsplit(".", 1)[-1]: gguf for gguf, hf in LLAMA_GGUF_LAYER_NAMES.items()}
_GLOBAL_ROLES = {
    name: gguf.removesuffix(".weight")
    for gguf, hf in LLAMA_GGUF_GLOBAL_NAMES.items()
    for name in (gguf, hf)
}
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.(?:.*\.)?(\w+)\.weight$")


def tensor_role(name: str) -> tuple[str, int | None]:
    """(role in GGUF's naming, layer index or None) of a checkpoint tensor's name, Hugging
    Face's (model.layers.3.self_attn.v_proj.weight) or GGUF's (blk.3.attn_v.weight); roles
    outside the layers: token_embd, output, output_norm; anything else: its own last part."""
    match = _LAYER.search(name)
    if match:
        return _HF_LAYER_ROLES.get(match[2], match[2]), int(match[1])
    if name in _GLOBAL_ROLES:
        return _GLOBAL_ROLES[name], None
    return name.rsplit(".", 1)[0], None


class QuantizationPlan:
    """The block type of each matrix of one model under plan `name` (a PLANS member)."""

    def __init__(self, name: str, num_layers: int, tied_embeddings: bool) -> None:
        if name not in PLANS:
            raise ValueError(f"quantization {name!r} is not one of {', '.join(PLANS)}.")
        self.name = name
        self.num_layers = num_layers
        self.tied = tied_embeddings

    def type_for(self, name: str, shape: tuple[int, ...]) -> GGMLType | None:
        """The block type of tensor `name` of `shape`, or None where it stays float."""
        if len(shape) != 2:
            return None
        if self.name in MIXES:
            role, layer = tensor_role(name)
            wanted = mix_type(self.name, role, layer, self.num_layers, self.tied)
        else:
            wanted = GGMLType[self.name.upper()]
        return quantized_type(wanted, shape[1])
