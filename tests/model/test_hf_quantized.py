"""Hugging Face checkpoints quantized by GPTQ, AWQ and compressed-tensors: a tiny random
Llama's linear weights quantized and packed as each format stores them (the writers below
follow each format's packing; compressed-tensors' own pack_to_int32 packs its int4 weights),
loaded by octavo as GGML blocks. The reference is transformers on the weights the packed
integers stand for (w = scale * (q - zero), computed in float32 from the stored scales): with
the float path (blocks dequantized, float32 GEMM) octavo equals it to float precision where the
mapping is exact (symmetric weights: Q4_0, Q8_0); asymmetric 4-bit weights become Q4_1, whose
offset -scale * zero is rounded to float16 (at most 2^-11 of it), stated where tested."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from octavo.model.loader import ModelLoadError, load_model

from .test_quantized import KQUANT_SHAPE, TOKENS, logits_of
from .tiny import cpu_backend, hf_logits, make_tiny_hf_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 / bits to an int32 along `dim` (value j at bits j * bits),
    as GPTQ packs its qweight (dim 0) and qzeros (dim 1)."""
    per_word = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    v = v.reshape(v.shape[0], -1, per_word)
    words = (v << (torch.arange(per_word) * bits)).sum(-1)
    packed = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    return packed.t().contiguous() if dim == 0 else packed


def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """(n, k) -> (n, k / group, group)."""
    n, k = weight.shape
    return weight.reshape(n, k // (group or k), -1)


def _asym_4bit(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """(q (n, k) in 0..15, scale (n, groups) float16, zero (n, groups) in 0..15)."""
    g = _groups(weight, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).to(torch.float16)
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    return q.clamp(0, 15).reshape(weight.shape).to(torch.int64), scale, zero.to(torch.int64)


def _sym(weight: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed q (n, k), scale (n, groups) float16)."""
    g = _groups(weight, group)
    top = 2 ** (bits - 1) - 1
    scale = (g.abs().amax(-1) / top).to(torch.float16)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-top - 1, top)
    return q.reshape(weight.shape).to(torch.int64), scale


def _dequantized(q, scale, zero, g_idx) -> torch.Tensor:
    """w = scale * (q - zero) in float32, each input with its group's."""
    return scale.float()[:, g_idx] * (q - zero[:, g_idx]).float()


def gptq_layer(weight, group: int, bits: int, sym: bool, v2: bool = False, g_idx=None):
    """GPTQ's tensors of one layer and the weight they stand for; `g_idx` (default: by
    position) assigns each input its group, as activation order does. The "gptq" format
    stores each zero minus 1 and its kernels add the 1 back (a stored 15 for zero 0 means
    16); "gptq_v2" stores the zero."""
    n, k = weight.shape
    if g_idx is None:
        g_idx = torch.arange(k) // (group or k)
    num_groups = int(g_idx.max()) + 1
    q = torch.empty(n, k, dtype=torch.int64)
    scale = torch.empty(n, num_groups, dtype=torch.float16)
    zero = torch.full((n, num_groups), 2 ** (bits - 1), dtype=torch.int64)
    for g in range(num_groups):
        cols = (g_idx == g).nonzero().flatten()
        if sym:
            signed, group_scale = _sym(weight[:, cols], 0, bits)
            q[:, cols] = signed + 2 ** (bits - 1)
        else:
            q[:, cols], group_scale, group_zero = _asym_4bit(weight[:, cols], 0)
            zero[:, g] = group_zero[:, 0]
        scale[:, g] = group_scale[:, 0]
    stored = zero if v2 else (zero - 1) & (2**bits - 1)
    effective = stored if v2 else stored + 1
    tensors = {
        "qweight": _pack(q.t(), bits, 0),  # (k / per_word, n)
        "qzeros": _pack(stored.t(), bits, 1),  # (groups, n / per_word)
        "scales": scale.t().contiguous(),  # (groups, n)
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, _dequantized(q, scale, effective, g_idx)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column AWQ_ORDER[j] of its 8


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) in 0..15 -> (rows, cols / 8) int32 in AWQ's column order."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    words = (v << (torch.arange(8) * 4)).sum(-1)
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def awq_layer(weight, group: int):
    q, scale, zero = _asym_4bit(weight, group)
    tensors = {
        "qweight": _awq_pack(q.t()),  # (k, n / 8)
        "qzeros": _awq_pack(zero.t()),  # (groups, n / 8)
        "scales": scale.t().contiguous(),  # (groups, n)
    }
    return tensors, _dequantized(q, scale, zero, torch.arange(weight.shape[1]) // group)


def ct_layer(weight, group: int, bits: int):
    """compressed-tensors' symmetric int weights, scales in bfloat16: pack-quantized (int4,
    packed by compressed-tensors itself) or int-quantized (int8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed, scale = _sym(weight, group, bits)
    scale = scale.to(torch.bfloat16)
    if bits == 4:
        tensors = {
            "weight_packed": pack_to_int32(signed.to(torch.int8), 4),
            "weight_scale": scale,
            "weight_shape": torch.tensor(weight.shape),
        }
    else:
        tensors = {"weight": signed.to(torch.int8), "weight_scale": scale}
    g_idx = torch.arange(weight.shape[1]) // (group or weight.shape[1])
    return tensors, _dequantized(signed, scale, torch.zeros_like(scale, dtype=torch.int64), g_idx)


def ct_config(bits: int, group: int) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "symmetric": True}
    weights.update({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if bits == 4 else "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


# name -> (quantization_config, writer of one layer's tensors, the block type they map to)
FORMATS = {
    "gptq-4bit-g128-sym": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
                           lambda w: gptq_layer(w, 128, 4, True), "Q4_0"),
    "gptq-4bit-g64-asym": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False},
                           lambda w: gptq_layer(w, 64, 4, False), "Q4_1"),
    "gptq-v2-4bit-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False,
                              "checkpoint_format": "gptq_v2"},
                             lambda w: gptq_layer(w, 0, 4, False, v2=True), "Q4_1"),
    "gptq-8bit-g128": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True},
                       lambda w: gptq_layer(w, 128, 8, True), "Q8_0"),
    "awq-4bit-g128": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                       "version": "gemm"}, lambda w: awq_layer(w, 128), "Q4_1"),
    "ct-w4a16-g32": (ct_config(4, 32), lambda w: ct_layer(w, 32, 4), "Q4_0"),
    "ct-w8a8-channel": (ct_config(8, 0), lambda w: ct_layer(w, 0, 8), "Q8_0"),
}  # fmt: skip


def write_quantized(folder: Path, quantization: dict[str, Any], layer, seed: int = 0):
    """A tiny Llama with every decoder linear layer written by `layer`; returns the
    transformers model holding the weights the checkpoint stands for."""
    hf_model = make_tiny_hf_model("llama", seed=seed, **KQUANT_SHAPE)
    hf_model.save_pretrained(folder)  # the config, tokenizer-free
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            prefix = name.removesuffix(".weight")
            if prefix.rsplit(".", 1)[-1] in LINEAR:
                parts, weight = layer(param.detach())
                tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
                param.copy_(weight)
            else:
                tensors[name] = param.detach().clone()
    for file in folder.glob("*.safetensors"):
        file.unlink()
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return hf_model


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_checkpoint_matches_transformers_on_its_weights(tmp_path, name):
    """The float path (blocks dequantized, float32 GEMM) against transformers on the weights
    the checkpoint stands for: to float precision where the mapping is exact; for Q4_1
    (asymmetric) within 0.5% of the logits' spread on average, what float16 offsets explain
    (measured 0.15-0.23%, against 1e-6 for the exact mappings). The block kernels (8-bit
    activations where they take them) stay within the bounds the GGUF files of the same types
    meet (test_quantized.py): 6% of the spread, the same greedy token at >= 75% of positions
    (measured 2-3.5%, all positions)."""
    quantization, layer, qtype = FORMATS[name]
    hf_model = write_quantized(tmp_path, quantization, layer)
    expected = hf_logits(hf_model, TOKENS)
    backend = cpu_backend(max_rows=0)
    model, config = load_model(str(tmp_path), backend)
    assert config.quantization_method == quantization["quant_method"]
    # Each layer's 4 projections (q/k/v and gate/up fused) in the type; the embedding and the
    # head stay float.
    formats = backend.weights_report["formats"]
    assert formats[qtype] == 2 * 4, formats
    assert not [f for f in formats if f != qtype and f.startswith("Q")], formats
    assert config.weight_block_types[-1] == qtype
    got = logits_of(model, backend, TOKENS)
    if qtype != "Q4_1":
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:
        assert (got - expected).abs().mean().item() < 0.005 * expected.std().item()
    fast_backend = cpu_backend()
    fast, _ = load_model(str(tmp_path), fast_backend)
    fast_logits = logits_of(fast, fast_backend, TOKENS)
    assert (fast_logits - expected).abs().mean().item() < 0.06 * expected.std().item()
    assert (fast_logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


def test_quantization_flag_names_the_checkpoints_own_method(tmp_path):
    """vLLM's --quantization gptq / awq / compressed-tensors read such a checkpoint as it is;
    another method's name, or a block type to quantize to, is refused naming what it is."""
    quantization, layer, _ = FORMATS["gptq-4bit-g128-sym"]
    write_quantized(tmp_path, quantization, layer)
    load_model(str(tmp_path), cpu_backend(max_rows=0), "gptq")
    with pytest.raises(ModelLoadError, match="quantization='awq' names the checkpoint's own"):
        load_model(str(tmp_path), cpu_backend(max_rows=0), "awq")
    with pytest.raises(ModelLoadError, match="already in Q4_0; serve it as it is"):
        load_model(str(tmp_path), cpu_backend(max_rows=0), "q8_0")
    # vLLM's names of its kernels for these checkpoints, from a launch script.
    from octavo.config import EngineArgs
    from octavo.entrypoints.cli import engine_args_from, make_parser

    assert EngineArgs(quantization="gptq_marlin").quantization == "gptq"
    parsed = make_parser().parse_args(["serve", "--quantization", "awq_marlin"])
    assert engine_args_from(parsed).quantization == "awq"


@pytest.mark.parametrize(
    "quantization, fragment",
    [
        ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes'.*does not load"),
        ({"quant_method": "gptq", "bits": 3}, "gptq checkpoint with bits=3"),
        ({"quant_method": "gptq", "bits": 8, "sym": False}, "asymmetric 8-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16 is not a multiple"),
        ({"quant_method": "awq", "version": "gemv"}, "awq checkpoint with version='gemv'"),
        ({**ct_config(4, 32), "format": "float-quantized"}, "format='float-quantized'"),
    ],
)
def test_what_does_not_map_is_refused_naming_it(tmp_path, quantization, fragment):
    write_quantized(tmp_path, quantization, FORMATS["gptq-4bit-g128-sym"][1])
    with pytest.raises(ModelLoadError, match=fragment):
        load_model(str(tmp_path), cpu_backend(max_rows=0))


def test_activation_order_maps_only_runs_of_32_inputs(tmp_path):
    """GPTQ's desc_act: a g_idx whose 32-input blocks each share a group (here the groups of
    128 inputs listed in reverse) loads with each block's scale; one that puts single inputs
    in other groups is refused naming activation order."""
    quantization = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                    "desc_act": True}  # fmt: skip

    def reversed_groups(weight):
        k = weight.shape[1]
        return gptq_layer(weight, 128, 4, False, g_idx=(k - 1 - torch.arange(k)) // 128)

    hf_model = write_quantized(tmp_path, quantization, reversed_groups)
    backend = cpu_backend(max_rows=0)
    model, _ = load_model(str(tmp_path), backend)
    got, expected = logits_of(model, backend, TOKENS), hf_logits(hf_model, TOKENS)
    assert (got - expected).abs().mean().item() < 0.005 * expected.std().item()

    def single_inputs(weight):
        g_idx = torch.arange(weight.shape[1]) // 128
        g_idx[0], g_idx[200] = 1, 0
        return gptq_layer(weight, 128, 4, False, g_idx=g_idx)

    write_quantized(tmp_path / "single", quantization, single_inputs)
    with pytest.raises(ModelLoadError, match="activation order"):
        load_model(str(tmp_path / "single"), cpu_backend(max_rows=0))
