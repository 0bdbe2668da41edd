"""Float weights reordered once for oneDNN's linear (model/cpu/onednn.py): the products of
torch's GEMM on the plain weight, in the Python formats and inside the one-call decode layer;
taken where the calibration measures them faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.model.cpu import build, calibration, fused, onednn
from octavo.model.cpu.calibration import MatmulCalibration
from octavo.model.formats import DenseWeight
from octavo.model.formats.packed import PackedWeight

from .tiny import PagedHarness, load, save_tiny_checkpoint

here = pytest.mark.skipif(
    not onednn.available(torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="no bfloat16 linear of oneDNN on this CPU",
)


def _within_bf16_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """got is x @ w^T + bias summed in float32 and rounded once to bfloat16: within half a
    bfloat16 unit of the exact product, plus float32 summation error (and the bias's add)."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = 2**-8 * exact.abs() + 1e-5 * magnitude + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@here
@pytest.mark.parametrize("n, k", [(96, 64), (100, 72), (3, 16)])
def test_onednn_linear_is_the_bf16_product_as_torchs_gemm_rounds_it(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = onednn.prepack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    assert onednn.nbytes(packed) == weight.numel() * 2
    for rows in (0, 1, 5, 33, 300):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for b in (None, bias):
            got = onednn.linear(x, packed, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            _within_bf16_rounding(got, x, weight, b)
            _within_bf16_rounding(F.linear(x, weight, b), x, weight, b)
    # The plain weight is untouched.
    again = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).bfloat16()
    assert torch.equal(weight, again)


def test_only_bf16_cpu_weights_are_reordered():
    assert not onednn.available(torch.zeros(4, 4))
    assert not onednn.available(torch.zeros(4, 4, 4, dtype=torch.bfloat16))


@here
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_format_with_the_copy_multiplies_by_it_as_by_its_plain_weight(monkeypatch, x_dtype):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).to(x_dtype)
    x = torch.randn(7, 24, generator=gen).to(x_dtype)
    plain = DenseWeight(weight)
    reordered = DenseWeight(weight)
    reordered.onednn_weight = onednn.prepack(weight)
    assert reordered.nbytes == 2 * plain.nbytes  # the copy is counted
    calls = []
    linear = onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a: calls.append(1) or linear(*a))
    got, expected = reordered.matmul(x, bias), plain.matmul(x, bias)
    assert calls == [1] and got.dtype == x_dtype
    # Both round the same float32 sums to bfloat16 (then add the bias in x's dtype).
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-2)


def test_the_copy_is_taken_where_it_is_faster_at_every_size_timed(monkeypatch):
    weight = torch.zeros(64, 32, dtype=torch.bfloat16)
    # (oneDNN s, torch s) per size of ONEDNN_CALIBRATION_ROWS, per shape timed.
    answers = iter([[(1.0, 2.0), (1.0, 2.0)], [(1.0, 2.0), (3.0, 2.0)]])
    timed_shapes = []

    def fake_timed_pair(kernel, other, k, dtype, repeats):
        timed_shapes.append(k)
        times = iter(next(answers))
        return lambda rows: next(times)

    monkeypatch.setattr(calibration, "_timed_pair", fake_timed_pair)
    timed = MatmulCalibration()
    assert timed.onednn_faster(weight, weight) is True
    assert timed.onednn_faster(weight * 2, weight) is True  # same shape: not timed again
    assert timed.onednn_faster(torch.zeros(64, 48, dtype=torch.bfloat16), weight) is False
    assert timed_shapes == [32, 48]
    shapes = timed.report()["shapes"]
    assert [(s["shape"], s["format"], s["chosen"]) for s in shapes] == [
        ([64, 32], "onednn", True),
        ([64, 48], "onednn", False),
    ]
    assert [rows for rows, *_ in shapes[1]["timings_ms"]] == list(
        calibration.ONEDNN_CALIBRATION_ROWS
    )
    # The fixed setting takes the copy without timing.
    assert MatmulCalibration(fixed_rows=8).onednn_faster(weight, weight) is True
    assert timed_shapes == [32, 48]


@here
@pytest.mark.skipif(not build.load(), reason="CPU kernels not built")
def test_the_one_call_layer_multiplies_by_the_copy_above_the_packed_limit(tmp_path):
    """bfloat16 weights under float32 compute (a native-bf16 CPU under --dtype auto): every
    projection gets the copy (fixed limit: nothing timed) and the start-up report counts its
    bytes. In a step of more rows than the packed limit the one-call decode layer multiplies
    by the copy in C++, as the formats do in Python: one projection's copy is made of other
    values on purpose, and the one-call layer's logits are still the layer-by-layer forward's,
    bit for bit, and no longer those of the plain weights."""
    save_tiny_checkpoint(tmp_path, "llama", seed=4)
    model, backend = load(tmp_path, max_rows=2, weight_dtype=torch.bfloat16)
    assert backend.fused_decode_layer == "on"
    formats = [m.weight_format for m in model.modules() if hasattr(m, "weight_format")]
    assert formats and all(isinstance(f, PackedWeight) for f in formats)
    assert all(f.onednn_weight is not None for f in formats)
    copies = sum(onednn.nbytes(f.onednn_weight) for f in formats)
    assert backend.weights_report["onednn_bytes"] >= copies > 0
    o_proj = model.model.layers[0].self_attn.o_proj.weight_format
    o_proj.onednn_weight = onednn.prepack(o_proj.weight * 2)
    model.model.fused_decode = fused.bind(model)
    prompts = {"a": [5, 9, 2, 7, 4], "b": [3, 8, 1, 6, 6, 2], "c": [7, 7, 1]}
    steps = [prompts] + [{r: [11 + i + s] for i, r in enumerate(prompts)} for s in range(3)]
    one_call = PagedHarness(model, backend, seed=3)
    fused_logits = [one_call.step(scheduled) for scheduled in steps]
    model.model.fused_decode = None
    layer_by_layer = PagedHarness(model, backend, seed=3)
    for scheduled, expected in zip(steps, fused_logits, strict=True):
        out = layer_by_layer.step(scheduled)
        assert all(torch.equal(out[r], expected[r]) for r in scheduled)
    o_proj.onednn_weight = None
    plain = PagedHarness(model, backend, seed=3)
    decode = [plain.step(scheduled) for scheduled in steps][1]
    assert not torch.allclose(decode["a"], fused_logits[1]["a"], atol=1e-3)
