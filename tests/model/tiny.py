"""Test helpers: tiny seeded Hugging Face checkpoints, and a paged harness that plays the runner.

`save_tiny_checkpoint` builds a 2-layer transformers model with weights drawn large enough that
attention is far from uniform and logits differ by more than the comparison tolerance, then
saves it with `save_pretrained`. `load` loads a checkpoint with a CPU backend of the attention
backend and dtypes asked for. `PagedHarness` owns a block pool with shuffled block ids and turns
"run these tokens for these requests" into one flat forward, the way the model runner does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from torch import Tensor, nn

from octavo.config import BackendConfig
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends import ModelBackend, select_backend
from octavo.model.config import ModelConfig
from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.kv_cache import allocate_kv_cache
from octavo.model.loader import load_model

# The attention backends every paged test runs with: the CPU paged kernels where they are
# built (auto), torch's SDPA over gathered blocks, and the plain-torch reference.
ATTENTION_BACKENDS = ["auto", "sdpa", "reference"]

_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "mistral": transformers.MistralConfig,
    "gemma2": transformers.Gemma2Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "olmo2": transformers.Olmo2Config,
    "olmoe": transformers.OlmoeConfig,
    "granite": transformers.GraniteConfig,
    "phi3": transformers.Phi3Config,
}

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_tiny_hf_model(model_type: str, seed: int = 0, **overrides: object) -> nn.Module:
    """A float32 transformers CausalLM of TINY_SHAPE (plus overrides), weights ~N(0, 0.2),
    biases ~N(0, 0.2), norm weights ~1 + N(0, 0.1)."""
    config = _CONFIG_CLASSES[model_type](**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def save_tiny_checkpoint(
    folder: Path,
    model_type: str,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: object,
) -> nn.Module:
    """Save make_tiny_hf_model(...) to `folder` (safetensors) and return the HF model."""
    model = make_tiny_hf_model(model_type, seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def hf_logits(model: nn.Module, token_ids: list[int]) -> Tensor:
    """(len(token_ids), vocab) float32 logits of one unbatched sequence."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def cpu_backend(
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: torch.dtype | None = None,
    attention: str = "auto",
    max_rows: int | None = None,
    weight_dtype: torch.dtype | None = None,
    bf16_gemm: bool = False,
) -> ModelBackend:
    """What select_backend gives a CPU engine with these dtypes and attention_backend.
    max_rows: the packed_max_rows setting (0: no packed or block kernel takes any matmul, so a
    GGUF's blocks are dequantized and multiplied in float: the float reference). bf16_gemm:
    block weights above their kernel's limit multiply in bfloat16 (a native-bf16 CPU's)."""
    config = BackendConfig(
        attention_backend=attention, packed_max_rows=max_rows, bf16_dequantized_gemm=bf16_gemm
    )
    return select_backend(torch.device("cpu"), dtype, kv_cache_dtype or dtype, config, weight_dtype)


def load(
    path: Path | str,
    attention: str = "auto",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: torch.dtype | None = None,
    max_rows: int | None = None,
    weight_dtype: torch.dtype | None = None,
    bf16_gemm: bool = False,
) -> tuple[nn.Module, ModelBackend]:
    """load_model with cpu_backend(...): the model and the backend it was built with."""
    backend = cpu_backend(dtype, kv_cache_dtype, attention, max_rows, weight_dtype, bf16_gemm)
    model, _ = load_model(str(path), backend)
    return model, backend


def float_weights(
    weights: Iterable[tuple[str, Tensor | QuantizedTensor]],
) -> Iterator[tuple[str, Tensor]]:
    """A loader's tensors with GGML blocks dequantized to float32 (the float reference)."""
    for name, tensor in weights:
        yield name, tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


@dataclass
class _RequestState:
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class PagedHarness:
    """Plays the model runner for tests: per request, a block list and a computed-token count.

    `step({"a": [ids...], "b": [id]})` runs those tokens of every request in one flat forward
    (in dict order) and returns the logits of every row, split per request.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: ModelBackend,
        num_blocks: int = 32,
        block_size: int = 4,
        seed: int = 0,
    ) -> None:
        """`model` was loaded with `backend`; the cache is of the backend's kv_cache_dtype."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks, block_size, backend.kv_cache_dtype, "cpu"
        )
        # Shuffled, so that a request's blocks are neither contiguous nor in order.
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free_block_ids = order.tolist()
        self.requests: dict[str, _RequestState] = {}

    def share_prefix(self, request_id: str, source_id: str, num_blocks: int) -> None:
        """Start `request_id` on the first num_blocks blocks of `source_id` (a prefix hit)."""
        source = self.requests[source_id]
        self.requests[request_id] = _RequestState(
            block_ids=source.block_ids[:num_blocks],
            num_computed_tokens=num_blocks * self.block_size,
        )

    def step(
        self, scheduled: dict[str, list[int]], output_rows: list[int] | None = None
    ) -> dict[str, Tensor] | Tensor:
        """With `output_rows` (indices into the step's flat rows), the model is asked for those
        rows only and their logits come back as one tensor, in that order."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for request_id, token_ids in scheduled.items():
            state = self.requests.setdefault(request_id, _RequestState())
            start = state.num_computed_tokens
            end = start + len(token_ids)
            while len(state.block_ids) * self.block_size < end:
                state.block_ids.append(self.free_block_ids.pop())
            for position in range(start, end):
                block_id = state.block_ids[position // self.block_size]
                slots.append(block_id * self.block_size + position % self.block_size)
            input_ids += token_ids
            positions += list(range(start, end))
            query_start_loc.append(query_start_loc[-1] + len(token_ids))
            seq_lens.append(end)
            state.num_computed_tokens = end
        width = max(len(self.requests[r].block_ids) for r in scheduled) + 1
        block_table = torch.zeros(len(scheduled), width, dtype=torch.int32)
        for row, request_id in enumerate(scheduled):
            block_ids = self.requests[request_id].block_ids
            block_table[row, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_table=block_table,
            block_size=self.block_size,
        )
        plan = self.backend.attention.plan_step(metadata, self.model.config.attention_windows)
        rows = None if output_rows is None else torch.tensor(output_rows, dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, plan, rows
            )
            logits = self.model.compute_logits(hidden)
        if rows is not None:
            return logits
        return {
            request_id: logits[query_start_loc[i] : query_start_loc[i + 1]]
            for i, request_id in enumerate(scheduled)
        }


# ------------------------------------------------------------------------ tiny GGUF files

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    # Phi-3's fused projections (ffn_up holds gate and up).
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
# The post-norm families (Gemma 2/3, OLMo 2) name their norms otherwise.
_SANDWICH_TO_GGUF = {
    **_HF_TO_GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_SANDWICH_ARCHS = ("gemma2", "gemma3", "olmo2")
_GGUF_HAS_PERMUTED_QK = ("llama", "granite")
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts."):  # a stack, as _gguf_ordered_state names it
        return f"blk.{layer}.{rest.removeprefix('mlp.experts.')}.weight"
    module, param = rest.rsplit(".", 1)
    names = _SANDWICH_TO_GGUF if arch in _SANDWICH_ARCHS else _HF_TO_GGUF_LAYER
    return f"blk.{layer}.{names[module]}.{param}"


def _gguf_ordered_state(hf_model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's tensors, with transformers 5's stacked experts (gate_up_proj: experts x
    2 inter x hidden, down_proj) as llama.cpp's three stacks, named mlp.experts.ffn_*_exps."""
    for hf_name, tensor in hf_model.state_dict().items():
        prefix, _, last = hf_name.rpartition(".experts.")
        if last == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            yield f"{prefix}.experts.ffn_gate_exps", gate
            yield f"{prefix}.experts.ffn_up_exps", up
        elif last == "down_proj":
            yield f"{prefix}.experts.ffn_down_exps", tensor
        else:
            yield hf_name, tensor


def permute_like_llama_cpp(weight: Tensor, num_heads: int) -> Tensor:
    """What llama.cpp's converter does to Llama q/k rows (pairs halves into adjacent rows)."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def unpermute_like_octavo(weight: Tensor, num_heads: int) -> Tensor:
    """The inverse of permute_like_llama_cpp."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def random_blocks(qtype: object, n: int, k: int, seed: int, std: float = 0.2) -> np.ndarray:
    """(n, row bytes) uint8 GGML blocks of `qtype` from random bits, their float16 scales set
    so that the weights they stand for (gguf's dequantization) have about `std`: any bit
    pattern is a valid block given finite scales, so this reaches every code of the type."""
    from gguf.quants import dequantize

    from octavo.model.formats.ggml import BLOCK_TYPES, row_bytes

    block = BLOCK_TYPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, row_bytes(qtype, k)), dtype=np.uint8)
    per_block = blocks.reshape(-1, block.type_size)

    def scales(offset: int) -> np.ndarray:
        return per_block[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)

    def set_scales(offset: int, values: np.ndarray) -> None:
        per_block[:, offset : offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)

    # Scales of either sign: the weights then centre on zero, as trained ones do (with positive
    # ones, the K-quants' minimums shift every weight of a row the same way).
    for offset in block.f16_offsets:
        signs = rng.choice([-1.0, 1.0], size=per_block.shape[0])
        set_scales(offset, signs * rng.uniform(0.5, 1.5, size=per_block.shape[0]))
    factor = std / float(dequantize(blocks, qtype).std())
    for offset in block.f16_offsets:
        set_scales(offset, scales(offset) * factor)
    return blocks


def quantize_tiny_model(
    hf_model: nn.Module, arch: str, tensor_types: dict[str, object], seed: int = 0
) -> dict[str, np.ndarray]:
    """GGML blocks for the GGUF tensors named in tensor_types (GGUF row order): the legacy types
    quantized by gguf from the model's weights, the K-quants (which gguf cannot quantize)
    random_blocks. The model's weights become what the blocks stand for (gguf's
    dequantization, in HF row order), so the model is the float reference of the file that
    write_tiny_gguf(..., blocks=...) writes."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    config = hf_model.config
    state = hf_model.state_dict()
    result = {}
    for index, (hf_name, tensor) in enumerate(state.items()):
        name = gguf_name(hf_name)
        qtype = tensor_types.get(name)
        if qtype is None:
            continue
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            heads = config.num_attention_heads
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            heads = config.num_key_value_heads
        ordered = tensor if heads is None else permute_like_llama_cpp(tensor, heads)
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
            blocks = quantize(ordered.float().numpy(), qtype)
        else:
            blocks = random_blocks(qtype, *ordered.shape, seed=seed + index)
        weight = torch.from_numpy(dequantize(blocks, qtype).reshape(ordered.shape).copy())
        if heads is not None:
            weight = unpermute_like_octavo(weight, heads)
        with torch.no_grad():
            hf_model.get_parameter(hf_name).copy_(weight)
        result[name] = blocks
    if getattr(config, "tie_word_embeddings", False) and hasattr(hf_model, "tie_weights"):
        hf_model.tie_weights()
    return result


def write_tiny_gguf(
    path: Path,
    hf_model: nn.Module,
    arch: str,
    tensor_types: dict[str, object] | None = None,
    blocks: dict[str, np.ndarray] | None = None,
) -> None:
    """Write hf_model as a GGUF file the way llama.cpp's converter would (metadata, names,
    Llama q/k permutation). tensor_types maps a GGUF tensor name to a GGMLQuantizationType;
    the rest are F32. `blocks` (quantize_tiny_model's) are written as they are for their
    names; the other tensors of tensor_types are quantized by gguf."""
    import gguf
    from gguf.quants import quantize

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # Gemma 3's global
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    num_experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        moe_size = getattr(config, "moe_intermediate_size", None)
        if moe_size:
            writer.add_expert_feed_forward_length(moe_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if hasattr(config, "norm_topk_prob"):
            writer.add_expert_weights_norm(config.norm_topk_prob)
    # The keys of the families that have them, as llama.cpp's converter writes them.
    if getattr(config, "sliding_window", None) and arch != "llama":
        writer.add_sliding_window(config.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            getattr(writer, f"add_{key}")(getattr(config, key))
    rope_type = rope.get("rope_type")
    if arch == "phi3" and rope_type == "longrope":
        # As llama.cpp's converter: the factors as tensors, the rest as rope.scaling keys.
        original = rope["original_max_position_embeddings"]
        factor = config.max_position_embeddings / original
        scale = rope.get("attention_factor") or math.sqrt(1 + math.log(factor) / math.log(original))
        writer.add_rope_scaling_attn_factors(scale)
        writer.add_rope_scaling_orig_ctx_len(original)
        for key, name in (
            ("long_factor", "rope_factors_long"),
            ("short_factor", "rope_factors_short"),
        ):
            writer.add_tensor(f"{name}.weight", np.asarray(rope[key], dtype=np.float32))
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    tensor_types = tensor_types or {}
    for hf_name, tensor in _gguf_ordered_state(hf_model):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_name(hf_name, arch)
        if arch in _GGUF_HAS_PERMUTED_QK and ".self_attn.q_proj." in hf_name:
            tensor = permute_like_llama_cpp(tensor, config.num_attention_heads)
        elif arch in _GGUF_HAS_PERMUTED_QK and ".self_attn.k_proj." in hf_name:
            tensor = permute_like_llama_cpp(tensor, config.num_key_value_heads)
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's x * (1 + w), as llama.cpp's converter stores it
        array = tensor.float().numpy()
        qtype = tensor_types.get(name, gguf.GGMLQuantizationType.F32)
        if blocks and name in blocks:
            writer.add_tensor(name, blocks[name], raw_dtype=qtype)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model_config(**overrides: object) -> ModelConfig:
    """The ModelConfig of a tiny Llama (TINY_SHAPE, head_dim 16), as a loader would read it."""
    fields = dict(
        architecture="LlamaForCausalLM",
        **TINY_SHAPE,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_out_bias=False,
        mlp_bias=False,
        qk_norm="",
        hidden_act="silu",
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return ModelConfig(**{**fields, **overrides})
