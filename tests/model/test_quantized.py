"""Weights in GGML block types, computed on their blocks.

The references, innermost first: gguf's numpy dequantization (what llama.cpp's own Python
package computes) for octavo's torch dequantization (formats/ggml.py); that for the C++
dequantization and block kernel (the kernel's only departure is x's rounding to 8 bits per 32
values, which the tests reproduce or bound); transformers on the dequantized weights for whole
tiny models written as GGUF files; and the float path (the same weights dequantized and
multiplied in float32) for the embedded model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from octavo.model.cpu import build, fused, ops
from octavo.model.formats import DenseWeight
from octavo.model.formats.base import ConcatWeight
from octavo.model.formats.ggml import BLOCK_TYPES, QuantizedTensor, dequantize
from octavo.model.formats.quantized import QuantizedWeight
from octavo.model.loader import find_default_model

from .tiny import (
    PagedHarness,
    hf_logits,
    load,
    make_tiny_hf_model,
    quantize_tiny_model,
    random_blocks,
    write_tiny_gguf,
)

kernels = pytest.mark.skipif(not build.load(), reason="CPU kernels not built")
tiles = pytest.mark.skipif(
    not (build.load() and ops.amx_tiles_available()),
    reason="no AMX tiles here: the CPU lacks amx_bf16 (or the OS does not give them)",
)

TYPES = list(BLOCK_TYPES)
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def blocks_of(qtype: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, n, k, seed))


def row_lengths(qtype: Q) -> list[int]:
    """Row lengths with every ending the kernels have: whole lane-order chunks only, chunks
    and a tail of one to seven 32-blocks, and a tail alone."""
    if BLOCK_TYPES[qtype].block_size == 256:
        return [256, 512, 1280]
    return [32, 96, 256, 576, 1536, 2080]


def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, d = max |x| / 127, q = round-half-even(x * (127 /
    max |x|)), x ~ d * q (the division written as the kernel computes it)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(amax, 127.0) / amax
    q = torch.where(amax > 0, torch.round(blocks * inverse), torch.zeros_like(blocks))
    return (q * (amax / 127)).reshape(x.shape)


# ------------------------------------------------------------------ the blocks


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_dequantization_equals_gguf(qtype):
    blocks = random_blocks(qtype, 24, 2 * BLOCK_TYPES[qtype].block_size * 4, seed=3)
    expected = gguf_dequantize(blocks, qtype)
    got = dequantize(torch.from_numpy(blocks), qtype, expected.shape[1])
    np.testing.assert_array_equal(got.numpy(), expected)


def test_random_blocks_reach_every_code():
    """The blocks the tests draw hold every value of every nibble (so no bit of a layout goes
    untested) and have finite weights of about the asked spread."""
    for qtype in TYPES:
        blocks = random_blocks(qtype, 64, 512, seed=1)
        assert len(np.unique(blocks & 0xF)) == 16 and len(np.unique(blocks >> 4)) == 16
        weights = gguf_dequantize(blocks, qtype)
        assert np.isfinite(weights).all()
        assert 0.1 < weights.std() < 0.4, qtype.name


def test_quantized_tensor_checks_its_blocks():
    with pytest.raises(ValueError, match="Q4_K blocks of a 4 x 512 tensor must be uint8"):
        QuantizedTensor(torch.zeros(4, 100, dtype=torch.uint8), Q.Q4_K, (4, 512))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        QuantizedTensor(torch.zeros(4, 100, dtype=torch.uint8), Q.Q4_K, (4, 300))


@kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_dequantization_is_exact(qtype):
    for k in row_lengths(qtype):
        blocks = blocks_of(qtype, 19, k, seed=k)
        for dtype in (torch.float32, torch.bfloat16):
            expected = dequantize(blocks, qtype, k, dtype)
            assert torch.equal(ops.quant_dequantize(blocks, qtype, k, dtype), expected)


@kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_kernel_equals_float_compute_on_rounded_activations(qtype):
    """With x rounded as the kernel rounds it, the kernel's product is the float product of
    the dequantized weights up to float32 summation: within 1e-5 of the sum of |terms|. Rows
    of x: one, a tile of four, and tiles with remainders."""
    n = 37
    for k in row_lengths(qtype):
        blocks = blocks_of(qtype, n, k, seed=k)
        weight = dequantize(blocks, qtype, k)
        for m in (1, 3, 4, 9):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                got = ops.quant_linear(x, blocks, qtype, n)
                rounded = rounded_to_8_bits(x)
                expected = rounded @ weight.T
                magnitude = rounded.abs() @ weight.abs().T
                assert ((got - expected).abs() <= 1e-5 * magnitude + 1e-6).all(), (k, m, dtype)


@kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_block_kernel_error_is_what_activation_rounding_explains(qtype):
    """Against the unrounded x, each output is off by at most what rounding x can do: every x
    moves by at most half a step, max |x| / 254 of its 32-block, so the output by at most the
    sum of |w| times that (plus float32 summation)."""
    k, n = 512, 64
    blocks = blocks_of(qtype, n, k, seed=5)
    weight = dequantize(blocks, qtype, k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    got = ops.quant_linear(x, blocks, qtype, n)
    half_step = (x.reshape(6, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_step.reshape(6, k) @ weight.abs().T
    error = (got - x @ weight.T).abs()
    assert (error <= bound * (1 + 1e-4) + 1e-5).all()
    # And x was rounded (the error is far above float32 summation's): independent roundings
    # add like a random walk, ~1/sqrt(k) of the worst case (measured 0.024 of it).
    assert error.mean() > 0.005 * bound.mean()


@tiles
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tile_kernel_is_the_float_product_of_bf16_rounded_operands(qtype):
    """The AMX tile kernel multiplies the weights dequantized to bfloat16 (exactly, as
    quant_dequantize rounds them) by x rounded to bfloat16, in float32: equal to that float
    product up to float32 summation, within 1e-5 of the sum of |terms|. Blocks as the file has
    them and repacked; 37 weight rows (a ragged 32-row tile); x rows of one tile, a ragged
    second tile, and more than one 256-row pass."""
    n = 37
    for k in row_lengths(qtype):
        blocks = blocks_of(qtype, n, k, seed=k)
        weight = dequantize(blocks, qtype, k).bfloat16().float()
        layouts = [(blocks, int(qtype))]
        if ops.quant_repacked_type(qtype) != qtype:
            layouts.append((ops.quant_repack(blocks, qtype, k), ops.quant_repacked_type(qtype)))
        for m in (1, 16, 17, 33, 300):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                rounded = x.bfloat16().float()
                expected = rounded @ weight.T
                magnitude = rounded.abs() @ weight.abs().T
                for layout, kind in layouts:
                    got = ops.quant_linear_tiles(x, layout, kind, n)
                    assert got.dtype == torch.float32 and got.shape == (m, n)
                    assert ((got - expected).abs() <= 1e-5 * magnitude + 1e-6).all(), (k, m)


# ------------------------------------------------------------------ the format


def quantized_weight(qtype: Q, n: int, k: int, max_rows: int, seed: int = 0) -> QuantizedWeight:
    tensor = QuantizedTensor(blocks_of(qtype, n, k, seed), qtype, (n, k))
    return QuantizedWeight(tensor, torch.float32, build.load(), max_rows)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_K], ids=lambda t: t.name)
def test_quantized_weight_paths_against_the_dense_weight(qtype):
    """Above max_rows (and without kernels, always) the format is the dense weight's own
    computation on the dequantized weight, so equal to it; at or below, the block kernel
    within the rounding bound of the kernel tests. Embedding rows are the dequantized rows."""
    k, n = 512, 48
    fmt = quantized_weight(qtype, n, k, max_rows=4)
    dense = DenseWeight(fmt.dequantize())
    bias = torch.randn(n)
    x = torch.randn(8, k)
    assert torch.equal(fmt.matmul(x, bias), dense.matmul(x, bias))
    if build.load():
        few = fmt.matmul(x[:3], bias)
        expected = rounded_to_8_bits(x[:3]) @ dense.weight.T + bias
        torch.testing.assert_close(few, expected, atol=1e-4, rtol=1e-5)
    ids = torch.tensor([5, 0, 47, 5])
    assert torch.equal(fmt.embedding(ids), dense.weight[ids])
    assert fmt.nbytes == n * k // BLOCK_TYPES[qtype].block_size * BLOCK_TYPES[qtype].type_size


@tiles
def test_quantized_weight_takes_the_tiles_between_its_two_limits():
    """Rows above max_rows and up to tiles_max_rows go to the tile kernel (the bf16 GEMM's
    rounding, float32 sums), more to dequantize-then-GEMM, fewer to the block kernel; the
    weight has tiles only where its GEMM is a bfloat16 one."""
    k, n = 512, 40
    tensor = QuantizedTensor(blocks_of(Q.Q4_K, n, k, seed=3), Q.Q4_K, (n, k))
    assert not QuantizedWeight(tensor, torch.float32, True, 2).tiles
    fmt = QuantizedWeight(tensor, torch.float32, True, 2, gemm_dtype=torch.bfloat16)
    assert fmt.tiles
    fmt.tiles_max_rows = 8
    x, bias = torch.randn(9, k), torch.randn(n)
    assert torch.equal(fmt.matmul(x[:2], bias), fmt.kernel_matmul(x[:2]) + bias)
    assert torch.equal(fmt.matmul(x[:8], bias), fmt.tiles_matmul(x[:8]) + bias)
    assert torch.equal(fmt.matmul(x, bias), fmt.gemm_matmul(x, bias))
    weight = tensor.dequantize().bfloat16().float()
    rounded = x[:8].bfloat16().float()
    got = fmt.matmul(x[:8], None)
    assert ((got - rounded @ weight.T).abs() <= 1e-5 * (rounded.abs() @ weight.abs().T)).all()


def test_concat_weight_stacks_its_parts():
    parts = [quantized_weight(Q.Q4_K, 32, 256, 0, seed=1), quantized_weight(Q.Q6_K, 16, 256, 0)]
    concat = ConcatWeight(parts)
    x, bias = torch.randn(5, 256), torch.randn(48)
    expected = torch.cat([parts[0].matmul(x, None), parts[1].matmul(x, None)], dim=1) + bias
    assert torch.equal(concat.matmul(x, bias), expected)
    assert concat.shape == (48, 256) and concat.name == "Q4_K+Q6_K"
    assert concat.nbytes == parts[0].nbytes + parts[1].nbytes
    assert torch.equal(concat.dequantize(), torch.cat([p.dequantize() for p in parts]))


# ------------------------------------------------------------------ tiny models in GGUF files

# hidden 256 and intermediate 512: rows of whole 256-weight super-blocks for the K-quants.
KQUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tiny_quantized_gguf(
    path: Path, arch: str, types: dict[str, Q], seed: int = 0, **overrides: object
) -> torch.nn.Module:
    """A tiny `arch` model with the given GGUF tensors in block types, written to `path`; returns
    the transformers model holding exactly the weights the file's blocks stand for."""
    hf_model = make_tiny_hf_model(arch, seed=seed, **{**KQUANT_SHAPE, **overrides})
    blocks = quantize_tiny_model(hf_model, arch, types, seed)
    write_tiny_gguf(path, hf_model, arch, types, blocks)
    return hf_model


def all_linear(qtype: Q, layers: int = 2) -> dict[str, Q]:
    return {f"blk.{i}.{name}.weight": qtype for i in range(layers) for name in LINEAR}


def logits_of(model, backend, token_ids):
    return PagedHarness(model, backend, num_blocks=16, block_size=4).step({"r": token_ids})["r"]


TOKENS = [3, 17, 200, 45, 9, 31, 128, 77, 5, 250, 64]


def emulated_logits(monkeypatch, model, backend, token_ids):
    """The logits of `model` with every block-type matmul replaced by its float reference on
    x rounded as the block kernel rounds it: what the kernel must compute, in float."""

    def matmul(self, x, bias):
        return F.linear(rounded_to_8_bits(x).to(x.dtype), self.dequantize(), bias)

    with monkeypatch.context() as patch:
        patch.setattr(QuantizedWeight, "matmul", matmul)
        return logits_of(model, backend, token_ids)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_in_each_type_matches_transformers(tmp_path, monkeypatch, arch, qtype):
    """Every linear weight in `qtype` (the K-quants' blocks random, the legacy ones quantized
    from the model). With no block kernel (dequantized, float32 GEMM) octavo equals
    transformers on the weights the blocks stand for, as float models do (1e-4). With the block
    kernel it follows that float computation on 8-bit-rounded activations (within 1% of the
    logits' spread on average); against transformers the rounding, compounded through a
    random model's layers, moves logits by 2-4% of their spread on average (measured), so:
    at most 6%, and the same greedy token at >= 75% of positions."""
    hf_model = tiny_quantized_gguf(tmp_path / "m.gguf", arch, all_linear(qtype))
    expected = hf_logits(hf_model, TOKENS)
    float_model, float_backend = load(tmp_path / "m.gguf", max_rows=0)
    torch.testing.assert_close(
        logits_of(float_model, float_backend, TOKENS), expected, atol=1e-4, rtol=1e-4
    )
    model, backend = load(tmp_path / "m.gguf")
    kind = model.model.layers[0].self_attn.qkv_proj.weight_format
    assert kind.name == qtype.name and kind.max_rows > 0
    got = logits_of(model, backend, TOKENS)
    if not build.load():
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        return
    spread = expected.std().item()
    emulated = emulated_logits(monkeypatch, model, backend, TOKENS)
    # Not equal to float32 precision: one float32 summation difference puts some later x on
    # the other side of a rounding boundary, and such steps compound. Measured 0.3-0.5% of
    # the spread on average, against 2-4% for the rounding itself.
    assert (got - emulated).abs().mean().item() < 0.01 * spread
    assert (got - expected).abs().mean().item() < 0.06 * spread
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


def test_q4_k_m_like_mix_with_quantized_embeddings(tmp_path, monkeypatch):
    """As a Q4_K_M file holds them: Q4_K q/k/gate/up, Q6_K v and down, Q6_K token embeddings
    (tied: the output projection too), F32 norms. Shards of two types make one projection of
    two parts; embeddings are looked up from the blocks; no float copy of a quantized weight
    is kept."""
    types = {}
    for i in range(2):
        for name in LINEAR:
            heavy = name in ("attn_v", "ffn_down")
            types[f"blk.{i}.{name}.weight"] = Q.Q6_K if heavy else Q.Q4_K
    types["token_embd.weight"] = Q.Q6_K
    hf_model = tiny_quantized_gguf(
        tmp_path / "m.gguf", "llama", types, seed=4, tie_word_embeddings=True
    )
    model, backend = load(tmp_path / "m.gguf")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_format.name == "Q4_K+Q6_K"
    assert model.model.embed_tokens.weight.device.type == "meta"
    assert all(
        p.device.type == "meta" for n, p in model.named_parameters() if "proj" in n or "embed" in n
    )
    report = backend.weights_report["bytes_by_type"]
    assert set(report) == {"Q4_K", "Q6_K", "float32"}
    float_model, float_backend = load(tmp_path / "m.gguf", max_rows=0)
    expected = hf_logits(hf_model, TOKENS)
    torch.testing.assert_close(
        logits_of(float_model, float_backend, TOKENS), expected, atol=1e-4, rtol=1e-4
    )
    got = logits_of(model, backend, TOKENS)
    if build.load():
        emulated = emulated_logits(monkeypatch, model, backend, TOKENS)
        assert (got - emulated).abs().mean().item() < 0.01 * expected.std().item()
    assert (got - expected).abs().mean().item() < 0.06 * expected.std().item()


@kernels
@pytest.mark.parametrize(
    "arch, bf16_gemm",
    [("llama", False), ("qwen2", False), ("llama", True)],  # qwen2: q/k/v biases
)
def test_one_call_decode_layers_on_blocks_equal_the_layer_by_layer_forward(
    tmp_path, monkeypatch, arch, bf16_gemm
):
    """All-decode steps of a block-weight model run each layer as one ops.decode_layer call
    (projections of one or two block types, repacked or not), with the same logits bit for bit
    as the layers' own forward, also in a step of more rows than the block weights' max_rows,
    where the call multiplies them by torch's GEMM (or the AMX tiles) as their formats do (a
    projection of two types each on its own side of its limit included)."""
    types = {}
    for i in range(2):
        for name, qtype in zip(LINEAR, (Q.Q4_K, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)):
            types[f"blk.{i}.{name}.weight"] = qtype
    tiny_quantized_gguf(tmp_path / "m.gguf", arch, types, seed=6)
    model, backend = load(tmp_path / "m.gguf", max_rows=2, bf16_gemm=bf16_gemm)
    assert backend.fused_decode_layer == "on"
    qkv = model.model.layers[0].self_attn.qkv_proj.weight_format
    assert qkv.name == "Q4_K+Q8_0"
    qkv.parts[1].max_rows = 3  # the 3-row step: Q4_K by the GEMM, Q8_0 by the kernel
    o_proj = model.model.layers[1].self_attn.o_proj.weight_format
    assert o_proj.gemm_dtype == (torch.bfloat16 if bf16_gemm else torch.float32)
    if o_proj.tiles:
        o_proj.tiles_max_rows = 3
    model.model.fused_decode = fused.bind(model)
    calls = []
    decode_layer = ops.decode_layer
    monkeypatch.setattr(ops, "decode_layer", lambda *a: calls.append(1) or decode_layer(*a))
    prompts = {"a": TOKENS[:5], "b": TOKENS[3:9], "c": TOKENS[1:4]}
    steps = [prompts]
    steps += [{"a": [3 + step], "b": [7 + step]} for step in range(3)]  # fused: 2 rows
    steps += [{r: [11 + i] for i, r in enumerate(prompts)}]  # 3 rows: GEMMs in the call
    one_call, plain = PagedHarness(model, backend, seed=3), PagedHarness(model, backend, seed=3)
    fused_logits = [one_call.step(scheduled) for scheduled in steps]
    assert len(calls) == 4 * model.config.num_hidden_layers
    model.model.fused_decode = None
    for scheduled, expected in zip(steps, fused_logits, strict=True):
        out = plain.step(scheduled)
        assert all(torch.equal(out[r], expected[r]) for r in scheduled)


def test_start_up_line_states_weight_bytes_by_type():
    from octavo.config import weights_line

    line = weights_line({"Q4_1": 66355200, "Q8_0": 30081024, "float32": 70272})
    assert line == "weights: 92.0 MiB (Q4_1 63.3 MiB, Q8_0 28.7 MiB, float32 0.1 MiB)"


# ------------------------------------------------------------------ the embedded model

EMBEDDED_PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 20486, 2],
    [1, 504, 3458, 282, 4649, 314],
    [1, 11185, 1342, 253, 655, 28],
    [1, 1030, 15439, 30, 77, 2683, 28],
    [1, 5248, 9689, 281, 260, 1789, 30],
    [1, 42, 28, 216, 43, 28, 216, 44, 28],
    [1, 2683, 3365, 2114, 28, 253, 5356],
    [1, 378, 1224, 282, 260, 2117, 314, 253],
]


def _greedy_run(harness, names, steps, forced=None):
    """Greedy decode of EMBEDDED_PROMPTS for `steps` tokens, one decode step per token (or
    teacher-forced with `forced`'s tokens): the tokens and the logprobs of each step."""
    out = harness.step(dict(zip(names, EMBEDDED_PROMPTS)))
    tokens = {name: [] for name in names}
    logprobs = {name: [] for name in names}
    for i in range(steps):
        step = {}
        for name in names:
            row = out[name][-1].log_softmax(-1)
            token = int(row.argmax()) if forced is None else forced[name][i]
            tokens[name].append(token)
            logprobs[name].append(row)
            step[name] = [token]
        out = harness.step(step)
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["shipped Q4_1", "q8_0", "q4_k_m"])
def test_embedded_model_native_agrees_with_the_float_path(tmp_path, weights):
    """The embedded model computed on its blocks against the same file's weights dequantized
    and multiplied in float32 (max_rows=0): as shipped (Q4_1), and as Q8_0 and Q4_K_M files
    made from it by `octavo convert --outtype`. The float path's greedy continuations (8
    prompts x 64 tokens) are teacher-forced through the native path one decode step at a time
    (the steps a server runs: the block kernel, the one-call layer), which gets the same greedy
    token at >= 95% of positions; the mean |difference| of the chosen tokens' logprobs is
    printed (and bounded)."""
    from octavo.model.convert import convert_gguf

    path = find_default_model()
    if weights != "shipped Q4_1":
        path = convert_gguf(path, tmp_path, weights, "gguf")
    float_model, float_backend = load(path, max_rows=0)
    names = [str(i) for i in range(len(EMBEDDED_PROMPTS))]
    float_harness = PagedHarness(float_model, float_backend, num_blocks=256, block_size=16)
    generated, float_rows = _greedy_run(float_harness, names, 64)
    del float_model, float_harness
    model, backend = load(path)
    if weights == "shipped Q4_1":
        assert backend.weights_report["formats"] == {"Q4_1": 120, "Q8_0": 1}
    assert backend.fused_decode_layer == "on"
    native = PagedHarness(model, backend, num_blocks=256, block_size=16)
    _, native_rows = _greedy_run(native, names, 64, forced=generated)
    agree, deltas = 0, []
    for name in names:
        for token, expected, got in zip(generated[name], float_rows[name], native_rows[name]):
            agree += int(got.argmax()) == token
            deltas.append(abs(got[token].item() - expected[token].item()))
    total = len(names) * 64
    mean_delta = sum(deltas) / len(deltas)
    print(f"{weights}: greedy agreement {agree}/{total}, mean |delta logprob| {mean_delta:.4f}")
    assert agree >= 0.95 * total
    assert mean_delta < 0.1


# ------------------------------------------------------------------ quantizing at load


def test_config_quantizations_are_the_plans():
    from octavo.config import QUANTIZATIONS
    from octavo.model.formats.ggml import MIXES, QUANTIZABLE_TYPES
    from octavo.model.loader.hf_quantized import METHODS
    from octavo.model.loader.quantization import PLANS

    assert ("gguf", *METHODS, *PLANS) == QUANTIZATIONS
    assert set(PLANS) == {t.name.lower() for t in QUANTIZABLE_TYPES} | set(MIXES)


@pytest.mark.parametrize("plan", ["q8_0", "q4_0", "q4_k", "q6_k", "q4_k_m"])
def test_float_checkpoint_quantized_at_load(tmp_path, plan):
    """--quantization on a safetensors folder: every matrix becomes blocks of the plan's type
    (q4_k_m: Q6_K for the tied embedding / output and the last layer's v and down, Q4_K
    elsewhere), rounded as formats.ggml.quantize rounds (gguf's quantizer for the 32-weight
    types), so the float path equals transformers on those rounded weights; the float
    parameters are gone."""
    from gguf.quants import dequantize as deq

    from octavo.model.formats.ggml import quantize
    from octavo.model.loader import load_model
    from octavo.model.loader.quantization import QuantizationPlan

    from .tiny import cpu_backend, save_tiny_checkpoint

    hf_model = save_tiny_checkpoint(
        tmp_path / "hf", "qwen2", seed=3, tie_word_embeddings=True, **KQUANT_SHAPE
    )
    backend = cpu_backend(max_rows=0)
    model, _ = load_model(str(tmp_path / "hf"), backend, plan)
    expected_formats = {"q4_k_m": {"Q4_K": 6, "Q4_K+Q6_K": 1, "Q6_K": 2}}.get(
        plan,
        {plan.upper(): 2 * 4 + 1},  # 4 per layer + the tied embedding and head
    )
    assert backend.weights_report["formats"] == expected_formats
    assert all(p.device.type == "meta" for p in model.parameters() if p.dim() == 2)
    rule = QuantizationPlan(plan, 2, tied_embeddings=True)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.dim() == 2:
                qtype = rule.type_for(name, tuple(param.shape))
                blocks = quantize(param, qtype).blocks.numpy()
                param.copy_(torch.from_numpy(deq(blocks, qtype).reshape(param.shape)))
    torch.testing.assert_close(
        logits_of(model, backend, TOKENS[:6]), hf_logits(hf_model, TOKENS[:6]), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    "qtype, bound", [(Q.Q4_K, 0.080), (Q.Q5_K, 0.040), (Q.Q6_K, 0.020)], ids=lambda v: str(v)
)
def test_k_quant_quantizer_error(qtype, bound):
    """Our K-quant quantizer (gguf has none): its blocks, read by gguf's own dequantization,
    stay within the RMS error the format allows on Gaussian weights (measured 0.072, 0.036,
    0.018 of the weights' RMS: bound 0.080, 0.040, 0.020) and beat the 32-weight type of the
    same bits per weight or fewer (Q4_1 for Q4_K, Q5_1 for Q5_K, Q8_0's is below Q6_K's by
    design, so Q6_K against Q5_1); with outliers, constant and zero sub-blocks every value is
    finite and zeros stay zero."""
    from octavo.model.formats.ggml import quantize

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(32, 1024, generator=generator)
    rms = weight.pow(2).mean().sqrt()

    def error(t):
        blocks = quantize(weight, t).blocks.numpy()
        restored = torch.from_numpy(gguf_dequantize(blocks, t).reshape(weight.shape))
        return ((restored - weight).pow(2).mean().sqrt() / rms).item()

    assert error(qtype) < bound
    assert error(qtype) < error({Q.Q4_K: Q.Q4_1, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q5_1}[qtype])
    hostile = torch.randn(4, 512, generator=generator)
    hostile[0, 3] = 1e4  # an outlier in a sub-block
    hostile[1, :256] = 0.25  # a constant super-block
    hostile[2] = 0  # a zero row
    hostile[3, 32:64] = -3.0  # a constant negative sub-block
    blocks = quantize(hostile, qtype).blocks.numpy()
    restored = torch.from_numpy(gguf_dequantize(blocks, qtype).reshape(hostile.shape))
    assert torch.isfinite(restored).all()
    assert torch.equal(restored[2], torch.zeros(512))
    torch.testing.assert_close(restored[1, :256], torch.full((256,), 0.25), atol=2e-3, rtol=0)
    torch.testing.assert_close(restored[0, 3], torch.tensor(1e4), atol=0, rtol=2e-2)


def test_quantization_plan_roles_and_fallbacks():
    """llama-quantize's Q4_K_M rule, read from Hugging Face and GGUF names alike: Q6_K for
    the output projection, attn_v and ffn_down in the first and last eighth of the layers and
    every third between (the 14 of 30 layers a 30-layer file holds), Q4_K elsewhere; rows that
    are not whole 256-blocks fall back (Q4_K -> Q5_0, Q6_K -> Q8_0), as in that file."""
    from octavo.model.loader.quantization import QuantizationPlan

    plan = QuantizationPlan("q4_k_m", 30, tied_embeddings=True)
    more = [i for i in range(30) if plan.type_for(f"blk.{i}.ffn_down.weight", (8, 512)) == Q.Q6_K]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    hf_name = "model.layers.5.self_attn.v_proj.weight"
    assert plan.type_for(hf_name, (8, 512)) == Q.Q6_K
    assert plan.type_for(hf_name, (8, 576)) == Q.Q8_0
    assert plan.type_for("model.layers.4.self_attn.v_proj.weight", (8, 576)) == Q.Q5_0
    assert plan.type_for("blk.4.attn_q.weight", (8, 512)) == Q.Q4_K
    assert plan.type_for("token_embd.weight", (8, 512)) == Q.Q6_K  # tied: the output too
    untied = QuantizationPlan("q4_k_m", 30, tied_embeddings=False)
    assert untied.type_for("model.embed_tokens.weight", (8, 512)) == Q.Q4_K
    assert untied.type_for("lm_head.weight", (8, 512)) == Q.Q6_K
    assert plan.type_for("model.norm.weight", (512,)) is None
    assert QuantizationPlan("q4_0", 30, True).type_for("blk.0.attn_q.weight", (8, 48)) is None


def test_quantization_that_does_not_apply_is_refused(tmp_path):
    from octavo.model.loader import ModelLoadError, load_model

    from .tiny import cpu_backend, save_tiny_checkpoint

    tiny_quantized_gguf(tmp_path / "m.gguf", "llama", all_linear(Q.Q4_K))
    with pytest.raises(ModelLoadError, match=r"already in Q4_K; serve it as it is"):
        load_model(str(tmp_path / "m.gguf"), cpu_backend(), "q8_0")
    load_model(str(tmp_path / "m.gguf"), cpu_backend(), "gguf")  # vLLM's spelling: accepted
    save_tiny_checkpoint(tmp_path / "hf", "llama")
    with pytest.raises(ModelLoadError, match="quantization='gguf' needs a GGUF file"):
        load_model(str(tmp_path / "hf"), cpu_backend(), "gguf")
    with pytest.raises(ModelLoadError, match="quantization='int3' is not supported"):
        load_model(str(tmp_path / "hf"), cpu_backend(), "int3")


@kernels
@pytest.mark.parametrize("qtype", [*LEGACY, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_repacked_layout_holds_the_same_weights(qtype):
    """Where the kernels repack a type (AVX-512 builds), the repacked bytes dequantize to the
    original blocks' weights exactly and multiply bit for bit as they do (the same lane-order
    sums), for rows with and without a partial last chunk."""
    repacked_type = ops.quant_repacked_type(qtype)
    if repacked_type == qtype:
        pytest.skip("no repacked layout in this build")
    for k in row_lengths(qtype):
        blocks = blocks_of(qtype, 21, k, seed=k)
        repacked = ops.quant_repack(blocks, qtype, k)
        assert repacked.shape == blocks.shape and not torch.equal(repacked, blocks)
        weights = ops.quant_dequantize(repacked, repacked_type, k, torch.float32)
        assert torch.equal(weights, dequantize(blocks, qtype, k))
        for m in (1, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            expected = ops.quant_linear(x, blocks, qtype, 21)
            assert torch.equal(ops.quant_linear(x, repacked, repacked_type, 21), expected)


def test_prompt_sized_matmul_in_bfloat16_where_the_cpu_has_it():
    """gemm_dtype=bfloat16 under float32 compute (a CPU with native bfloat16): above max_rows
    the weight is dequantized to bfloat16 (exactly the bf16 rounding of its float value) and x
    rounded to bfloat16, products summed by torch's bf16 GEMM; within the bf16 bound of the
    float product."""
    tensor = QuantizedTensor(blocks_of(Q.Q4_K, 40, 512, seed=2), Q.Q4_K, (40, 512))
    fmt = QuantizedWeight(tensor, torch.float32, build.load(), 4, gemm_dtype=torch.bfloat16)
    x, bias = torch.randn(9, 512), torch.randn(40)
    got = fmt.matmul(x, bias)
    weight = tensor.dequantize()
    expected = F.linear(x.bfloat16(), weight.bfloat16()).float() + bias
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    magnitude = x.abs() @ weight.abs().T
    assert ((got - (x @ weight.T + bias)).abs() <= 2**-7 * magnitude).all()
