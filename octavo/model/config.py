"""ModelConfig: the one description of a model's shape that the model code reads.

Built once, from a Hugging Face `config.json` dict (plus `generation_config.json`) or from GGUF
metadata, and frozen afterwards. Every architecture difference the model code needs (biases,
per-head q/k norms, RoPE variant) is resolved here into plain fields, with what the
architecture's ArchSpec (model/arch.py) fixes, so model files never look at raw config dicts.
This module must not import torch, the loader or anything that knows about requests: invalid or
unsupported settings raise ValueError naming the key and its value, and the loader turns that
into a ModelLoadError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from octavo.config import sampling_defaults_from
from octavo.model.arch import get_gguf_spec, get_spec

# RoPE variants whose inverse frequencies octavo computes (HF `rope_type` names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# The MLP activations (HF's hidden_act names; Gemma's GeGLU is the tanh GELU).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF semantics, always keyed by "rope_type"; None for plain RoPE.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v projections (Llama's `attention_bias`; always on for Qwen2).
    attention_bias: bool
    # Bias on o_proj (Llama and Qwen3 tie it to `attention_bias`; Qwen2 has none).
    attention_out_bias: bool
    mlp_bias: bool
    # RMSNorm on q and k before RoPE: "head" over head_dim on every head (Qwen3, Gemma 3),
    # "full" over the whole q and k projections (OLMo 2, OLMoE); "" none.
    qk_norm: str
    # The MLP's activation (HF's hidden_act name).
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # The dtype the checkpoint declares ("bfloat16", ...), for dtype="auto"; None if unknown.
    checkpoint_dtype: str | None = None
    # Sampling defaults the model ships in generation_config.json, as SamplingParams field
    # names (vLLM applies them when a request leaves the field unset); sorted (name, value).
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # The GGML block types its weights are held in (a quantized GGUF file's "Q4_K", "Q6_K"),
    # sorted; empty for float checkpoints.
    weight_block_types: tuple[str, ...] = ()
    # The method a Hugging Face checkpoint was quantized with ("gptq", "awq",
    # "compressed-tensors"; its weights then in weight_block_types); None: not one.
    quantization_method: str | None = None
    # Mixture of experts (0 experts: dense). Each token's router picks num_experts_per_tok of
    # num_experts gated MLPs of moe_intermediate_size, weighted by its softmax probabilities,
    # renormalised over the chosen ones where norm_topk_prob; a shared expert of
    # shared_expert_intermediate_size (0: none) is added under a sigmoid gate (Qwen2-MoE).
    # dense_layers: the layers that keep the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # Attention per layer: the layers in sliding_layers see only the last sliding_window
    # positions (transformers' sliding window; 0: none), with their own RoPE where local_rope
    # gives (theta, scaling) (Gemma 3's local base). attention_scale multiplies q.k (None:
    # head_dim ** -0.5); attention scores and final logits are soft-capped, cap * tanh(x / cap),
    # where a cap is set (Gemma 2; 0: none).
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    local_rope: tuple[float, dict | None] | None = None
    attention_scale: float | None = None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Scalars of the residual stream: embeddings times embedding_multiplier (Granite's; Gemma's
    # sqrt(hidden_size)), each attention and MLP output times residual_multiplier before its
    # residual add, logits divided by logits_scaling (Granite).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Pooling: the architecture's default pooling type where it is a pooling model (ArchSpec;
    # None: a generation model), and Matryoshka embeddings (a request's `dimensions` may keep
    # a prefix of the vector: any length where is_matryoshka, one of matryoshka_dimensions
    # where the config lists them).
    default_pooling_type: str | None = None
    # An encoder's (BERT): attention sees the whole prompt both ways, and token types (only
    # type 0 is used) have their own embeddings.
    is_causal: bool = True
    type_vocab_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                f"{self.num_experts}, with a positive moe_intermediate_size "
                f"(got {self.moe_intermediate_size})."
            )

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder layer `layer` (0-based), 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (empty: every layer sees everything)."""
        return (self.sliding_window,) if self.sliding_layers else ()

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the experts, not the dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Resolve an HF config dict (transformers 4 or 5 layout) into a ModelConfig.

        Raises ValueError for a missing `architectures` entry, an unsupported architecture,
        activation or RoPE type, or inconsistent head counts.
        """
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class.")
        architecture = architectures[0]
        spec = get_spec(architecture)
        hidden_act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        if spec.is_causal and hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act={hidden_act!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})."
            )

        num_heads = _required(config, "num_attention_heads")
        hidden_size = _required(config, "hidden_size")
        num_layers = _required(config, "num_hidden_layers")
        rope_theta, rope_scaling = _resolve_rope(_global_rope(config))
        attention_bias = bool(config.get("attention_bias", False))
        if spec.qkv_bias is not None:
            attention_bias = spec.qkv_bias
        attention_out_bias = attention_bias if spec.o_proj_bias is None else spec.o_proj_bias

        generation_config = generation_config or {}
        # generation_config.json is what HF's generate() stops on; config.json is the fallback.
        eos = _first_set(generation_config, config, "eos_token_id")
        bos = _first_set(config, generation_config, "bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            # An encoder's LayerNorm eps in the same field.
            rms_norm_eps=float(config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            hidden_act=hidden_act,
            bos_token_id=bos,
            eos_token_ids=_as_id_tuple(eos),
            checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
            sampling_defaults=_sampling_defaults(generation_config),
            **(_moe_fields(config, spec.moe) if spec.moe else {}),
            **_pooling_fields(config, spec.default_pooling_type),
            is_causal=spec.is_causal,
            type_vocab_size=int(config.get("type_vocab_size", 0)) if not spec.is_causal else 0,
            **_attention_fields(config, num_layers, spec.model_type),
            **_scalar_fields(config, spec.model_type, hidden_size),
        )

    # ---------------------------------------------------------------- GGUF metadata

    @classmethod
    def from_gguf(
        cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
    ) -> ModelConfig:
        """Resolve GGUF key/value metadata into a ModelConfig.

        `metadata` maps GGUF keys ("llama.block_count", ...) to scalar values; `tensor_shapes`
        maps GGUF tensor names to their shapes in row-major (PyTorch) order. The shapes decide
        what metadata may omit: the vocabulary size and whether embeddings are tied (no
        `output.weight`). Raises ValueError for an unsupported `general.architecture`.
        """
        arch = metadata.get("general.architecture")
        spec = get_gguf_spec(arch)

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{key}", default)

        if "token_embd.weight" not in tensor_shapes:
            raise ValueError("GGUF file has no token_embd.weight tensor.")
        # Missing keys stay None here; from_hf_config names the first required one absent.
        hf: dict[str, Any] = {
            "architectures": [spec.name],
            "vocab_size": get("vocab_size") or tensor_shapes["token_embd.weight"][0],
            "hidden_size": get("embedding_length"),
            "intermediate_size": get("feed_forward_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": get("attention.head_count"),
            "num_key_value_heads": get("attention.head_count_kv"),
            "head_dim": get("attention.key_length"),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": get("rope.freq_base", 10000.0),
            "max_position_embeddings": get("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            # A GGUF file has biases exactly where it has bias tensors.
            "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        }
        num_experts = get("expert_count") or 0
        if num_experts:
            # llama.cpp's MoE keys; its graphs renormalise the chosen experts' weights for
            # Mixtral and Qwen3-MoE and not for Qwen2-MoE or OLMoE, unless the file says
            # otherwise.
            if spec.name == "LlamaForCausalLM":
                hf["architectures"] = ["MixtralForCausalLM"]
            hf["num_experts"] = num_experts
            hf["num_experts_per_tok"] = get("expert_used_count")
            hf["moe_intermediate_size"] = get("expert_feed_forward_length")
            hf["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
            renormalised = spec.name not in ("Qwen2MoeForCausalLM", "OlmoeForCausalLM")
            hf["norm_topk_prob"] = get("expert_weights_norm", renormalised)
        hf.update(spec.gguf_implied)
        # llama.cpp's Gemma files carry no query_pre_attn_scalar; its graphs take hidden / heads
        # for the 27B models (46 layers of Gemma 2, 62 of Gemma 3), whose configs say the same,
        # and head_dim for the others, as theirs do.
        gemma = spec.model_type in ("gemma2", "gemma3_text")
        if gemma and hf["num_attention_heads"] and hf["num_hidden_layers"] in (46, 62):
            hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
        for key, hf_key in _GGUF_OPTIONAL_KEYS.items():
            if get(key) is not None:
                hf[hf_key] = get(key)
        scaling_type = get("rope.scaling.type")
        if "rope.long_factor" in metadata:
            # LongRoPE (Phi-3): the factors come from their tensors (the loader puts them here),
            # the scale of cos/sin and the pretraining context from rope.scaling.*.
            hf["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": metadata["rope.long_factor"],
                "short_factor": metadata["rope.short_factor"],
                "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                "attention_factor": get("rope.scaling.attn_factor"),
            }
        elif scaling_type not in (None, "none"):
            hf["rope_scaling"] = {"rope_type": scaling_type, "factor": get("rope.scaling.factor")}
        # llama.cpp stops on end-of-turn tokens as well as EOS; keep both, EOS first.
        eos_ids = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
        hf["eos_token_id"] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        config = cls.from_hf_config(hf)
        if config.attention_out_bias and "blk.0.attn_output.bias" not in tensor_shapes:
            # Llama-style configs tie the o_proj bias to the q/k/v one; GGUF says it directly.
            config = dataclasses.replace(config, attention_out_bias=False)
        return config


# -------------------------------------------------------------------- helpers

# GGUF metadata keys (after "<arch>.") some architectures carry -> the HF config key.
_GGUF_OPTIONAL_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    # Granite's scalars.
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}


def _required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config is missing the required key {key!r}.")
    return config[key]


def _resolve_rope(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout: transformers 5 writes one
    `rope_parameters` dict holding rope_theta and rope_type; transformers 4 writes `rope_theta`
    plus an optional `rope_scaling` dict whose type key may be "type" or "rope_type"."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported.")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "longrope":
        return float(theta), _longrope(config, params)
    if params.get("factor") is None:
        raise ValueError(f"rope_type={rope_type!r} needs a 'factor'.")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ValueError(f"rope_type='llama3' needs {key!r}.")
    return float(theta), {"rope_type": rope_type, **params}


def _longrope(config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE as transformers computes it: per-frequency divisors, short_factor below
    original_max_position_embeddings and long_factor beyond, cos and sin scaled by
    attention_factor (given, or sqrt(1 + ln(factor) / ln(original)) where factor, given or
    max_position_embeddings / original, exceeds 1)."""
    original = params.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )
    if not original:
        raise ValueError("rope_type='longrope' needs 'original_max_position_embeddings'.")
    for key in ("short_factor", "long_factor"):
        if not params.get(key):
            raise ValueError(f"rope_type='longrope' needs {key!r}.")
    factor = params.get("factor") or int(config.get("max_position_embeddings", 2048)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in params["short_factor"]],
        "long_factor": [float(f) for f in params["long_factor"]],
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def _global_rope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config as _resolve_rope reads it for the full-attention layers: transformers 5
    writes Gemma 3's rope_parameters per layer type."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        return {**config, "rope_parameters": params["full_attention"]}
    return config


def _layer_types(config: Mapping[str, Any], num_layers: int, model_type: str) -> list[str]:
    """Each layer's "full_attention" or "sliding_attention", as transformers derives them:
    config.json's `layer_types` where it has one; else Gemma 2 alternates (sliding first),
    Gemma 3 makes every sliding_window_pattern-th layer full, Qwen2 slides from
    max_window_layers on when use_sliding_window, and the others slide everywhere when they
    have a window (Qwen's only with use_sliding_window)."""
    if config.get("layer_types"):
        types = list(config["layer_types"])
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers.")
        return types
    window = config.get("sliding_window")
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = int(config.get("sliding_window_pattern") or 6)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    # Qwen's configs carry a window they only use with use_sliding_window (default off).
    if window is None or not config.get("use_sliding_window", not model_type.startswith("qwen")):
        return ["full_attention"] * num_layers
    first = int(config.get("max_window_layers") or 0) if "max_window_layers" in config else 0
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def _attention_fields(
    config: Mapping[str, Any], num_layers: int, model_type: str
) -> dict[str, Any]:
    """sliding_window and its layers, Gemma 3's local RoPE, the attention scale and the two
    soft-caps (see ModelConfig)."""
    types = _layer_types(config, num_layers, model_type)
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported.")
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    window = int(config.get("sliding_window") or 0)
    if sliding and window < 1:
        raise ValueError("sliding layers without a positive 'sliding_window'.")
    fields: dict[str, Any] = {
        "sliding_window": window if sliding else 0,
        "sliding_layers": sliding,
        "attn_logit_softcapping": float(config.get("attn_logit_softcapping") or 0.0),
        "final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0),
    }
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:
        fields["local_rope"] = _resolve_rope({"rope_parameters": params["sliding_attention"]})
    elif config.get("rope_local_base_freq") is not None:  # transformers 4's Gemma 3
        fields["local_rope"] = (float(config["rope_local_base_freq"]), None)
    if config.get("query_pre_attn_scalar") is not None:  # Gemma
        fields["attention_scale"] = float(config["query_pre_attn_scalar"]) ** -0.5
    elif config.get("attention_multiplier") is not None:  # Granite
        fields["attention_scale"] = float(config["attention_multiplier"])
    return fields


def _scalar_fields(config: Mapping[str, Any], model_type: str, hidden_size: int) -> dict[str, Any]:
    """The residual stream's multipliers (see ModelConfig)."""
    if model_type in ("gemma2", "gemma3_text"):
        return {"embedding_multiplier": hidden_size**0.5}
    return {
        "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "logits_scaling": float(config.get("logits_scaling", 1.0)),
    }


def _moe_fields(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The mixture-of-experts fields of an HF config. kind "mixtral": every layer routes to
    experts of `intermediate_size` and renormalises the chosen probabilities ("olmoe": the
    same, renormalised where `norm_topk_prob`); "qwen"
    (Qwen3-MoE) and "qwen2" (Qwen2-MoE, with its shared expert): `moe_intermediate_size`,
    `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`. transformers 5 writes the count as
    `num_local_experts` for both, transformers 4 as `num_experts` for Qwen."""
    num_experts = config.get("num_experts") or _required(config, "num_local_experts")
    fields = {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(_required(config, "num_experts_per_tok")),
    }
    if kind in ("mixtral", "olmoe"):
        # Every layer routes, to experts of intermediate_size; Mixtral always renormalises.
        return {
            **fields,
            "moe_intermediate_size": int(_required(config, "intermediate_size")),
            "norm_topk_prob": kind == "mixtral" or bool(config.get("norm_topk_prob", False)),
        }
    layers = int(_required(config, "num_hidden_layers"))
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = set(config.get("mlp_only_layers") or ())
    return {
        **fields,
        "moe_intermediate_size": int(_required(config, "moe_intermediate_size")),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
        if kind == "qwen2"
        else 0,
        "dense_layers": tuple(i for i in range(layers) if i in only_dense or (i + 1) % step != 0),
    }


def _pooling_fields(config: Mapping[str, Any], default_pooling_type: str | None) -> dict[str, Any]:
    """The pooling fields of a config.json (vLLM's is_matryoshka / matryoshka_dimensions)."""
    dimensions = config.get("matryoshka_dimensions")
    return {
        "default_pooling_type": default_pooling_type,
        "is_matryoshka": bool(dimensions) or bool(config.get("is_matryoshka", False)),
        "matryoshka_dimensions": tuple(dimensions) if dimensions else None,
    }


def _first_set(first: Mapping[str, Any], second: Mapping[str, Any], key: str) -> Any:
    value = first.get(key)
    return second.get(key) if value is None else value


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sampling_defaults(generation_config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(sampling_defaults_from(generation_config).items()))
