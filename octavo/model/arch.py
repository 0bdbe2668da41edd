"""ArchSpec: everything octavo knows of one architecture, in one place.

A spec says how the architecture's config maps from a Hugging Face config.json and from GGUF
metadata (what it fixes whatever the file says), its GGUF tensor names and the row permutation
llama.cpp's converter applies, its model class, what `octavo convert` writes for it, and which
fused paths it opts into. Adding an architecture is one model file built from the shared layers
(or none, when an existing class covers it) plus one spec in SPECS. Plain Python, no torch: the
config code (model/config.py) and the converter read specs before any model exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from octavo.model.config import ModelConfig

# llama.cpp's tensor names outside the layers, and per layer (blk.N.<name>.weight|bias), as its
# converter writes them for the Llama family -> the Hugging Face module names.
LLAMA_GGUF_GLOBAL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
LLAMA_GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)

# The mixture-of-experts tensors of llama.cpp's MoE files (Mixtral as "llama", qwen2moe,
# qwen3moe): the router and Qwen2-MoE's shared expert by name; each `*_exps` tensor stacks
# every expert's matrix along its first dimension, expert N's becoming mlp.experts.N.<name>.
LLAMA_GGUF_MOE_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    }
)
LLAMA_GGUF_EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
)
_LLAMA_MOE_LAYER_NAMES = MappingProxyType({**LLAMA_GGUF_LAYER_NAMES, **LLAMA_GGUF_MOE_NAMES})


@dataclass(frozen=True)
class ArchSpec:
    # HF `architectures[0]`, and config.json's `model_type` for it.
    name: str
    model_type: str
    # "module:Class" of the model, imported only when a model is built.
    model_class: str
    # GGUF `general.architecture` files of this architecture carry; None where llama.cpp writes
    # another's (Mistral is written as "llama").
    gguf_name: str | None = None
    # What the architecture fixes whatever config.json says: biases on q/k/v (None: the
    # config's `attention_bias`) and on o_proj (None: the same as q/k/v), and RMSNorms on q
    # and k before RoPE: "head" over head_dim on every head (Qwen3, Gemma 3), "full" over the
    # whole projections (OLMo 2, OLMoE), "" none.
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    qk_norm: str = ""
    # llama.cpp's converter interleaves the two halves of each head's q/k rows (its RoPE pairs
    # dimensions 2i and 2i + 1); the loader undoes it for these architectures.
    gguf_permute_qk: bool = False
    gguf_global_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_GLOBAL_NAMES)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    # What a GGUF file of this architecture implies that its metadata does not say, as HF
    # config keys (Gemma's activation, Gemma 3's local RoPE base and layer pattern, as
    # llama.cpp fixes them).
    gguf_implied: Mapping[str, Any] = field(default_factory=dict)
    # llama.cpp's converter adds this to every norm weight (Gemma's 1 + w); the loader takes
    # it off again, so that the model reads the checkpoint's convention from either source.
    gguf_norm_offset: float = 0.0
    # config.json keys `octavo convert` writes for this model_type beyond the shared ones; may
    # raise ValueError where transformers has no field for what the model does.
    hf_config_extras: Callable[[ModelConfig], dict[str, Any]] = lambda config: {}
    # Opt-in to the CPU's one-call decoder layer (model/cpu/fused.py), which checks the loaded
    # model as well.
    fused_decode_layer: bool = False
    # Mixture of experts: how config.json describes them (model/config.py, _moe_fields:
    # "mixtral", "qwen2" with a shared expert, "qwen" for Qwen3-MoE); None: dense.
    moe: str | None = None
    # Checkpoint tensor names -> octavo's module names, as (old, new) substrings replaced in
    # order (Mixtral's block_sparse_moe.experts.N.w1 is mlp.experts.N.gate_proj here).
    hf_renames: tuple[tuple[str, str], ...] = ()
    # A pooling model's architecture (a decoder saved as its bare `*Model`, an encoder): how
    # it pools by default (LAST, MEAN, CLS), which also makes it serve embeddings unless
    # told otherwise; None: a generation model (which `--convert embed` can still pool).
    default_pooling_type: str | None = None
    # False for an encoder (BERT): bidirectional attention, each prompt run whole in one step,
    # no KV cache reuse across steps.
    is_causal: bool = True


def _one_attention_bias(config: ModelConfig) -> dict[str, Any]:
    """Llama, Mistral and Qwen3 configs have one `attention_bias` for q/k/v and o_proj alike."""
    if config.attention_bias != config.attention_out_bias:
        raise ValueError(
            f"{config.architecture} with attention_bias={config.attention_bias} but o_proj "
            f"bias={config.attention_out_bias} has no transformers config."
        )
    return {"attention_bias": config.attention_bias}


def _llama_extras(config: ModelConfig) -> dict[str, Any]:
    return {**_one_attention_bias(config), "mlp_bias": config.mlp_bias}


def _moe_extras(config: ModelConfig) -> dict[str, Any]:
    """The expert keys of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json (transformers 4's
    names, which 5 reads as well)."""
    if config.architecture == "MixtralForCausalLM":
        if config.moe_intermediate_size != config.intermediate_size or not config.norm_topk_prob:
            raise ValueError("Mixtral's experts are of intermediate_size and renormalised.")
        return {
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
        }
    extras: dict[str, Any] = {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.dense_layers),
    }
    if config.architecture == "Qwen2MoeForCausalLM":
        extras["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        extras["use_sliding_window"] = False
    else:
        extras.update(_one_attention_bias(config))
    return extras


def _not_written(config: ModelConfig) -> dict[str, Any]:
    raise ValueError(f"octavo convert does not write {config.architecture} folders yet.")


_LLAMA_CLASS = "octavo.model.llama:LlamaForCausalLM"

# The post-norm families' tensor names (llama.cpp: post_attention_norm, ffn_norm before the
# MLP, post_ffw_norm after it).
_SANDWICH_GGUF_LAYER_NAMES = MappingProxyType(
    {
        **LLAMA_GGUF_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
)
_GEMMA_GGUF = MappingProxyType({"hidden_activation": "gelu_pytorch_tanh"})

SPECS: tuple[ArchSpec, ...] = (
    ArchSpec(
        name="LlamaForCausalLM",
        model_type="llama",
        model_class=_LLAMA_CLASS,
        gguf_name="llama",
        gguf_permute_qk=True,
        hf_config_extras=_llama_extras,
        fused_decode_layer=True,
    ),
    # Mistral checkpoints are Llama with other names (the sliding window becomes a context cap
    # in ModelConfig).
    ArchSpec(
        name="MistralForCausalLM",
        model_type="mistral",
        model_class=_LLAMA_CLASS,
        gguf_permute_qk=True,
        hf_config_extras=_llama_extras,
        fused_decode_layer=True,
    ),
    # Qwen2 / Qwen2.5: always q/k/v biases, never an o_proj bias; its config has no flag.
    ArchSpec(
        name="Qwen2ForCausalLM",
        model_type="qwen2",
        model_class=_LLAMA_CLASS,
        gguf_name="qwen2",
        qkv_bias=True,
        o_proj_bias=False,
        hf_config_extras=lambda config: {"use_sliding_window": False},
        fused_decode_layer=True,
    ),
    # Qwen3 (dense): per-head q/k norms; head_dim from the config (it need not be hidden /
    # heads).
    ArchSpec(
        name="Qwen3ForCausalLM",
        model_type="qwen3",
        model_class=_LLAMA_CLASS,
        gguf_name="qwen3",
        qk_norm="head",
        hf_config_extras=_one_attention_bias,
        fused_decode_layer=True,
    ),
    # Mixture-of-experts Llama-family decoders: the same attention, the MLP replaced by
    # top-k routed experts (model/layers/moe.py). llama.cpp writes Mixtral as "llama" with an
    # expert count (ModelConfig.from_gguf picks this spec for such a file).
    ArchSpec(
        name="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        model_class=_LLAMA_CLASS,
        gguf_name="qwen3moe",
        qk_norm="head",
        gguf_layer_names=_LLAMA_MOE_LAYER_NAMES,
        hf_config_extras=_moe_extras,
        fused_decode_layer=True,
        moe="qwen",
    ),
    ArchSpec(
        name="Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        model_class=_LLAMA_CLASS,
        gguf_name="qwen2moe",
        qkv_bias=True,
        o_proj_bias=False,
        gguf_layer_names=_LLAMA_MOE_LAYER_NAMES,
        hf_config_extras=_moe_extras,
        fused_decode_layer=True,
        moe="qwen2",
    ),
    ArchSpec(
        name="MixtralForCausalLM",
        model_type="mixtral",
        model_class=_LLAMA_CLASS,
        gguf_permute_qk=True,
        gguf_layer_names=_LLAMA_MOE_LAYER_NAMES,
        hf_config_extras=_moe_extras,
        fused_decode_layer=True,
        moe="mixtral",
        hf_renames=(
            (".block_sparse_moe.", ".mlp."),
            (".w1.", ".gate_proj."),
            (".w3.", ".up_proj."),
            (".w2.", ".down_proj."),
        ),
    ),
    # Gemma 2, Gemma 3 (text), OLMo 2: norms after each sublayer (model/gemma.py). llama.cpp
    # rotates their q/k as transformers does (no permutation).
    ArchSpec(
        name="Gemma2ForCausalLM",
        model_type="gemma2",
        model_class="octavo.model.gemma:Gemma2ForCausalLM",
        gguf_name="gemma2",
        gguf_layer_names=_SANDWICH_GGUF_LAYER_NAMES,
        gguf_implied=_GEMMA_GGUF,
        gguf_norm_offset=1.0,
        hf_config_extras=_not_written,
    ),
    ArchSpec(
        name="Gemma3ForCausalLM",
        model_type="gemma3_text",
        model_class="octavo.model.gemma:Gemma2ForCausalLM",
        gguf_name="gemma3",
        qk_norm="head",
        gguf_layer_names=_SANDWICH_GGUF_LAYER_NAMES,
        gguf_implied=MappingProxyType(
            {**_GEMMA_GGUF, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}
        ),
        gguf_norm_offset=1.0,
        hf_config_extras=_not_written,
    ),
    ArchSpec(
        name="Olmo2ForCausalLM",
        model_type="olmo2",
        model_class="octavo.model.gemma:Olmo2ForCausalLM",
        gguf_name="olmo2",
        qk_norm="full",
        gguf_layer_names=_SANDWICH_GGUF_LAYER_NAMES,
        hf_config_extras=_not_written,
    ),
    # Phi-3: q/k/v and gate/up fused in the checkpoint (model/phi3.py), LongRoPE; llama.cpp
    # writes the fused tensors too (attn_qkv; ffn_up holding gate and up) and rotates as
    # transformers does.
    ArchSpec(
        name="Phi3ForCausalLM",
        model_type="phi3",
        model_class="octavo.model.phi3:Phi3ForCausalLM",
        gguf_name="phi3",
        gguf_layer_names=MappingProxyType(
            {
                **LLAMA_GGUF_LAYER_NAMES,
                "attn_qkv": "self_attn.qkv_proj",
                "ffn_up": "mlp.gate_up_proj",
            }
        ),
        hf_config_extras=_not_written,
    ),
    # Granite: Llama with four scalars (ModelConfig's multipliers).
    ArchSpec(
        name="GraniteForCausalLM",
        model_type="granite",
        model_class=_LLAMA_CLASS,
        gguf_name="granite",
        gguf_permute_qk=True,
        hf_config_extras=_not_written,
        fused_decode_layer=True,
    ),
    # OLMoE: Llama-style pre-norms, q/k norms over whole projections, 64 experts of
    # intermediate_size each.
    ArchSpec(
        name="OlmoeForCausalLM",
        model_type="olmoe",
        model_class=_LLAMA_CLASS,
        gguf_name="olmoe",
        qk_norm="full",
        gguf_layer_names=_LLAMA_MOE_LAYER_NAMES,
        hf_config_extras=_not_written,
        fused_decode_layer=True,
        moe="olmoe",
    ),
)

# The bare decoder stacks (transformers' AutoModel: no lm_head, tensor names without the
# `model.` prefix), which vLLM serves as embedding models pooling the last token: the same
# model class as their causal LM, loaded as an embedder.
_BARE_DECODERS = {
    "LlamaForCausalLM": "LlamaModel",
    "MistralForCausalLM": "MistralModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}
SPECS += (
    # BERT: an encoder with absolute positions and post-LN layers; pools its [CLS] token
    # unless its sentence-transformers folder says otherwise.
    ArchSpec(
        name="BertModel",
        model_type="bert",
        model_class="octavo.model.bert:BertModel",
        hf_config_extras=_not_written,
        default_pooling_type="CLS",
        is_causal=False,
    ),
)
SPECS += tuple(
    dataclasses.replace(
        spec, name=_BARE_DECODERS[spec.name], gguf_name=None, default_pooling_type="LAST"
    )
    for spec in SPECS
    if spec.name in _BARE_DECODERS
)

_BY_NAME = {spec.name: spec for spec in SPECS}
_BY_GGUF = {spec.gguf_name: spec for spec in SPECS if spec.gguf_name is not None}


def supported_architectures() -> list[str]:
    return sorted(_BY_NAME)


def get_spec(architecture: str) -> ArchSpec:
    """The spec of an HF architecture name; ValueError naming it and the supported ones."""
    spec = _BY_NAME.get(architecture)
    if spec is None:
        raise ValueError(
            f"Architecture {architecture!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})."
        )
    return spec


def get_gguf_spec(gguf_name: Any) -> ArchSpec:
    """The spec of a GGUF `general.architecture`; ValueError naming it and the supported ones."""
    spec = _BY_GGUF.get(gguf_name)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {gguf_name!r} is not supported "
            f"(supported: {', '.join(sorted(_BY_GGUF))})."
        )
    return spec


def load_model_class(spec: ArchSpec) -> type:
    """The model class a spec names, imported now."""
    import importlib

    module_name, _, class_name = spec.model_class.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
