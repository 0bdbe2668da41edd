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
    the same mlp.experts.N.gate_up_proj / down_proj as Qwen's, and the fused decode layer,
    which has no experts, stays off."""
    hf_model = save_tiny_checkpoint(tmp_path, "mixtral", num_local_experts=3)
    model, backend = load(tmp_path)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == 3
    assert isinstance(layer.mlp.experts[0], GatedMLP)
    hf_experts = hf_model.model.layers[0].mlp.experts
    # transformers 5 holds them stacked: gate_up_proj (experts, 2 * inter, hidden).
    torch.testing.assert_close(layer.mlp.experts[2].gate_up_proj.weight, hf_experts.gate_up_proj[2])
    torch.testing.assert_close(layer.mlp.experts[1].down_proj.weight, hf_experts.down_proj[1])
    assert backend.fused_decode_layer == "off: MixtralForCausalLM does not use it"
