"""SparseMoE against a per-token reference, and the MoE architectures' configs and modules.

The models themselves are compared with transformers in test_models_vs_transformers.py (the
MoE rows of its VARIANTS table); here the layer's grouping of tokens by expert is checked
against the plainest reading of top-k routing: for each token on its own, its k experts'
outputs weighted by their (renormalised) probabilities."""

from __future__ import annotations

import pytest
import torch

from octavo.model.backends.torch_ops import TorchOps
from octavo.model.config import ModelConfig
from octavo.model.formats import DenseWeight
from octavo.model.layers.linear import Linear
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.moe import SparseMoE

from .test_models_vs_transformers import _config
from .tiny import load, save_tiny_checkpoint


def _moe(renormalize: bool, shared: int, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    layer = SparseMoE(16, 8, 6, 2, renormalize, "silu", TorchOps(), shared)
    for module in layer.modules():
        if isinstance(module, Linear):
            module.weight.data.normal_(0, 0.5)
            module.weight_format = DenseWeight(module.weight)
    return layer


def _per_token(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in x:
        probs = (layer.gate.weight @ token).softmax(-1)
        weights, experts = probs.topk(layer.top_k)
        if layer.renormalize:
            weights = weights / weights.sum()
        row = sum(w * layer.experts[int(e)](token[None])[0] for w, e in zip(weights, experts))
        if layer.shared_expert is not None:
            gate = torch.sigmoid(layer.shared_expert_gate.weight @ token)
            row = row + gate * layer.shared_expert(token[None])[0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize(("renormalize", "shared"), [(True, 0), (False, 0), (False, 12)])
def test_grouped_experts_equal_the_per_token_reference(renormalize, shared):
    layer = _moe(renormalize, shared)
    x = torch.randn(23, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x)
        expected = _per_token(layer, x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Enough tokens that every expert was chosen by some and not by others.
    _, experts = layer.route(x)
    assert set(experts.flatten().tolist()) == set(range(6))


def test_one_token_and_no_tokens():
    layer = _moe(True, 0)
    with torch.no_grad():
        x = torch.randn(1, 16)
        torch.testing.assert_close(layer(x), _per_token(layer, x), atol=1e-5, rtol=1e-5)
        assert layer(torch.zeros(0, 16)).shape == (0, 16)


def _moe_hf(architecture: str, **keys) -> dict:
    return {
        "architectures": [architecture],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        **keys,
    }


def test_moe_configs_read_each_familys_keys():
    mixtral = ModelConfig.from_hf_config(
        _moe_hf("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    )
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (
        8,
        48,
        True,
    )
    assert [mixtral.is_moe_layer(i) for i in range(4)] == [True] * 4
    # transformers 4's key (num_experts), every second layer sparse, layer 1 dense by name.
    qwen3 = ModelConfig.from_hf_config(
        _moe_hf(
            "Qwen3MoeForCausalLM",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    assert qwen3.qk_norm and not qwen3.norm_topk_prob
    assert qwen3.dense_layers == (0, 2, 3)
    assert qwen3.shared_expert_intermediate_size == 0
    qwen2 = ModelConfig.from_hf_config(
        _moe_hf(
            "Qwen2MoeForCausalLM",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        )
    )
    assert (qwen2.shared_expert_intermediate_size, qwen2.attention_bias) == (24, True)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_config(
            _moe_hf("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=5)
        )
    assert _config().num_experts == 0 and not _config().is_moe_layer(0)


def test_mixtral_checkpoint_names_load_into_the_shared_modules(tmp_path):
    """Mixtral's checkpoints name experts block_sparse_moe.experts.N.w1/w2/w3; they land in
    the same mlp.experts.N.gate_up_proj / down_proj as Qwen's."""
    hf_model = save_tiny_checkpoint(tmp_path, "mixtral", num_local_experts=3)
    model, backend = load(tmp_path)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == 3
    assert isinstance(layer.mlp.experts[0], GatedMLP)
    hf_experts = hf_model.model.layers[0].mlp.experts
    # transformers 5 holds them stacked: gate_up_proj (experts, 2 * inter, hidden).
    torch.testing.assert_close(layer.mlp.experts[2].gate_up_proj.weight, hf_experts.gate_up_proj[2])
    torch.testing.assert_close(layer.mlp.experts[1].down_proj.weight, hf_experts.down_proj[1])
    assert backend.fused_decode_layer == "on"  # its attention half; the experts after it


# (transformers model_type, llama.cpp's GGUF architecture, config overrides) of each MoE family.
GGUF_FAMILIES = [
    ("mixtral", "llama", {"num_local_experts": 4}),
    ("qwen3_moe", "qwen3moe", {"num_experts": 4, "moe_intermediate_size": 32}),
    (
        "qwen2_moe",
        "qwen2moe",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    ),
]


@pytest.mark.parametrize(("model_type", "arch", "overrides"), GGUF_FAMILIES)
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_gguf_of_experts_gives_the_logits_of_its_float_reference(
    tmp_path, model_type, arch, overrides, qtype
):
    """llama.cpp's layout: Mixtral as "llama" with an expert count, qwen2moe / qwen3moe, each
    expert stack one 3-D tensor (`ffn_*_exps`, here in F32 or Q8_0 blocks, which octavo splits
    into each expert's blocks), the router as ffn_gate_inp. The reference: transformers on the
    weights the blocks stand for."""
    import gguf

    from .tiny import hf_logits, make_tiny_hf_model, write_tiny_gguf

    hf_model = make_tiny_hf_model(model_type, num_experts_per_tok=2, **overrides)
    types = {}
    if qtype == "Q8_0":
        types = {
            f"blk.{i}.ffn_{p}_exps.weight": gguf.GGMLQuantizationType.Q8_0
            for i in range(2)
            for p in ("gate", "up", "down")
        }
    blocks = _quantize_expert_stacks(hf_model, types)
    path = tmp_path / "moe.gguf"
    write_tiny_gguf(path, hf_model, arch, types, blocks)
    model, backend = load(path, max_rows=0)
    assert model.config.architecture == type(hf_model).__name__
    layer = model.model.layers[1]
    assert isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == 4
    tokens = list(range(3, 14))
    expected = hf_logits(hf_model, tokens)
    torch.testing.assert_close(_logits(model, backend, tokens), expected, atol=1e-4, rtol=1e-4)
    if qtype == "Q8_0":
        # The experts' blocks in the block kernel (8-bit activations; the bound of
        # test_quantized's tiny GGUF comparison).
        model, backend = load(path)
        fmt = model.model.layers[0].mlp.experts[3].down_proj.weight_format
        assert fmt.name == "Q8_0"
        spread = expected.std().item()
        assert (_logits(model, backend, tokens) - expected).abs().mean().item() < 0.06 * spread


def _logits(model, backend, token_ids):
    from .tiny import PagedHarness

    return PagedHarness(model, backend).step({"r": token_ids})["r"]


def _quantize_expert_stacks(hf_model, types) -> dict:
    """Blocks for the stacks named in `types` (gguf's Q8_0 of each), and the HF model's
    stacked experts set to what the blocks stand for, so it stays the file's float reference."""
    from gguf.quants import dequantize, quantize

    result = {}
    for i, layer in enumerate(hf_model.model.layers):
        experts = layer.mlp.experts
        gate, up = experts.gate_up_proj.data.chunk(2, dim=1)
        stacks = {"gate": gate, "up": up, "down": experts.down_proj.data}
        for part, tensor in stacks.items():
            name = f"blk.{i}.ffn_{part}_exps.weight"
            if name not in types:
                continue
            blocks = quantize(tensor.float().numpy(), types[name])
            result[name] = blocks
            tensor.copy_(torch.from_numpy(dequantize(blocks, types[name]).reshape(tensor.shape)))
    return result


@pytest.mark.parametrize(("model_type", "arch", "overrides"), GGUF_FAMILIES)
def test_octavo_convert_writes_a_folder_transformers_loads(
    tmp_path, monkeypatch, model_type, arch, overrides
):
    """GGUF -> Hugging Face folder: config.json gets each family's expert keys and the tensors
    their checkpoint names (Mixtral's block_sparse_moe.experts.N.w1/w2/w3), so transformers
    loads the folder and computes the logits of the model the file was written from."""
    import transformers

    from octavo.model.convert import write_hf_folder
    from octavo.model.loader.gguf import open_gguf_checkpoint

    from .tiny import hf_logits, make_tiny_hf_model, write_tiny_gguf

    hf_model = make_tiny_hf_model(model_type, num_experts_per_tok=2, **overrides)
    write_tiny_gguf(tmp_path / "moe.gguf", hf_model, arch)
    # convert_gguf's own path, less the tokenizer (the tiny file has none).
    config, weights = open_gguf_checkpoint(tmp_path / "moe.gguf")
    folder = tmp_path / "hf"
    folder.mkdir()
    monkeypatch.setattr("octavo.model.convert.save_tokenizer_files", lambda *args: None)
    write_hf_folder(config, weights, None, folder, "float32")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = list(range(3, 12))
    torch.testing.assert_close(
        hf_logits(reloaded, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4
    )
