"""select_backend's rules, the weight formats it hands out, the matmul calibration, and the CPU
layer ops against TorchOps (their reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.config import BackendConfig, EngineArgs, PlatformInfo, resolve_dtype
from octavo.model.backends import select_backend
from octavo.model.backends.cpu import CpuKernelOps
from octavo.model.backends.torch_ops import TorchOps
from octavo.model.cpu import build, calibration, ops, packing
from octavo.model.cpu.calibration import PACKED_MAX_ROWS, MatmulCalibration
from octavo.model.formats import DenseWeight
from octavo.model.formats.packed import PackedWeight
from octavo.model.layers.linear import Linear, PackedLinear

kernels_built = pytest.mark.skipif(not build.load(), reason="CPU kernels not built")
CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


NATIVE_BF16_CPU = PlatformInfo("cpu", "cpu", "avx512_bf16", 1 << 30)
PLAIN_CPU = PlatformInfo("cpu", "cpu", "", 1 << 30)


def test_auto_dtype_on_a_native_bfloat16_cpu_is_float32_over_bfloat16_weights():
    assert resolve_dtype("auto", NATIVE_BF16_CPU)[:2] == ("float32", "bfloat16")
    assert resolve_dtype("auto", PLAIN_CPU)[:2] == ("float32", None)
    # Block weights stay blocks; a dtype asked for is that dtype throughout.
    assert resolve_dtype("auto", NATIVE_BF16_CPU, ("Q4_K",))[:2] == ("float32", None)
    assert resolve_dtype("bfloat16", NATIVE_BF16_CPU)[:2] == ("bfloat16", None)


@pytest.mark.parametrize(
    ("settings", "weights", "cache"),
    [
        ({}, "bfloat16", "bfloat16"),
        ({"kv_cache_dtype": "float32"}, "bfloat16", "float32"),
        ({"dtype": "float32"}, None, "float32"),
        ({"packed_max_rows": 0}, None, "float32"),  # the float reference
    ],
)
def test_the_engine_config_carries_the_weight_dtype_and_the_cache_follows_it(
    settings, weights, cache
):
    from .test_models_vs_transformers import _config

    config = EngineArgs(kv_cache_tokens=1024, **settings).create_engine_config(
        NATIVE_BF16_CPU, _config(), "model"
    )
    assert (config.dtype, config.weight_dtype, config.cache.dtype) == ("float32", weights, cache)


def _choices(dtype, kv_dtype, **config) -> dict:
    backend = select_backend(CPU, dtype, kv_dtype, BackendConfig(**config))
    choices = backend.describe()
    return {
        key: choices[key] for key in ("attention", "layer_ops", "sampler_draw", "sampler_argmax")
    }


@kernels_built
def test_the_cpu_rules_pick_by_dtype_and_cache():
    assert _choices(F32, BF16) == {
        "attention": "cpu_paged",
        "layer_ops": "cpu_kernels",
        "sampler_draw": "cpu_kernel" if build.vectorized() else "torch",
        "sampler_argmax": "cpu_kernel" if build.vectorized() else "torch",
    }
    # bfloat16 compute: the paged kernels read the cache, the elementwise ops are torch's.
    assert _choices(BF16, BF16)["attention"] == "cpu_paged"
    assert _choices(BF16, BF16)["layer_ops"] == "torch"
    # A float16 cache is not one the paged kernels read.
    assert _choices(F32, F16)["attention"] == "sdpa"
    assert _choices(F32, F32, attention_backend="reference")["attention"] == "reference"
    assert _choices(F32, F32, attention_backend="sdpa")["layer_ops"] == "cpu_kernels"


def test_without_kernels_everything_is_torch():
    backend = select_backend(CPU, F32, F32, BackendConfig(cpu_kernels=False))
    assert _choices(F32, F32, cpu_kernels=False) == {
        "attention": "sdpa",
        "layer_ops": "torch",
        "sampler_draw": "torch",
        "sampler_argmax": "torch",
    }
    assert backend.describe()["cpu_kernels"] == "off: cpu_kernels=False"
    model = torch.nn.Sequential(Linear(8, 8, bias=False))
    assert backend.prepare_weights(model)["formats"] == {"dense": 1}
    assert type(model[0].weight_format) is DenseWeight


def test_an_attention_backend_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend(CPU, F32, F32, BackendConfig(attention_backend="flash"))
    with pytest.raises(ValueError, match="attention_backend='cpu_paged' needs the CPU kernels"):
        select_backend(
            CPU, F32, F32, BackendConfig(attention_backend="cpu_paged", cpu_kernels=False)
        )


# ---------------------------------------------------------------------- weight formats


@kernels_built
def test_packed_weight_routes_by_rows_and_keeps_results(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).bfloat16().float()
    bias = torch.randn(48, generator=gen)
    fmt = PackedWeight(weight, packing.pack_linear_weight(weight), max_rows=8)
    calls = []
    real = ops.packed_linear
    monkeypatch.setattr(ops, "packed_linear", lambda *a: calls.append(1) or real(*a))
    for rows, kernel_calls in ((8, 1), (9, 0)):
        calls.clear()
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(
            fmt.matmul(x, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5
        )
        assert len(calls) == kernel_calls
    # A bf16 input comes back in bf16 from either path.
    assert fmt.matmul(torch.randn(3, 40).bfloat16(), None).dtype == torch.bfloat16
    assert fmt.nbytes == 48 * 40 * 4 + fmt.packed.numel() * 2
    assert torch.equal(fmt.dequantize(), weight)


@kernels_built
def test_prepared_weights_are_bf16_only_when_lossless_and_share_one_allocation():
    exact = torch.randn(16, 8).bfloat16().float()
    inexact = exact.clone()
    inexact[3, 5] += 1e-4
    layer, other = Linear(8, 16, bias=False), Linear(8, 16, bias=False)
    with torch.no_grad():
        layer.weight.copy_(exact)
        other.weight.copy_(inexact)
    backend = select_backend(CPU, F32, F32, BackendConfig(packed_max_rows=64))
    report = backend.prepare_weights(torch.nn.Sequential(layer, other))
    padded = -(-16 // build.panel_width()) * build.panel_width()  # rows, with the padding
    assert report["formats"] == {"packed-bfloat16": 1, "packed-float32": 1}
    assert report["packed_bytes"] == padded * 8 * 2 + padded * 8 * 4
    assert report["matmul_calibration"] == {"fixed_max_rows": 64}
    first, second = layer.weight_format, other.weight_format
    assert (first.packed.dtype, second.packed.dtype) == (torch.bfloat16, torch.float32)
    assert first.max_rows == second.max_rows == 64
    assert first.packed.untyped_storage().data_ptr() == second.packed.untyped_storage().data_ptr()
    assert torch.equal(first.packed, packing.pack_linear_weight(exact))
    assert torch.equal(second.packed, packing.pack_linear_weight(inexact))
    x = torch.randn(2, 8)
    # Either copy holds the weight's numbers, so outputs are what fp32 gives.
    torch.testing.assert_close(layer(x), F.linear(x, exact), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other(x), F.linear(x, inexact), atol=1e-5, rtol=1e-5)
    assert packing.pack_linear_weight(exact.half()) is None  # no kernel for fp16 weights


@kernels_built
def test_each_layer_gets_its_shapes_limit_the_output_projection_too(monkeypatch):
    """Each packed weight is timed, the output projection too: its decode-sized batches (the
    sampled rows) may also be faster by torch's GEMM on a CPU whose bf16 GEMM has AMX."""
    limits = iter([24, 8, 4])
    monkeypatch.setattr(
        MatmulCalibration, "packed_max_rows", lambda self, weight, packed: next(limits)
    )
    model = torch.nn.Module()
    model.qkv = PackedLinear(8, {"q": 16, "k": 8}, bias=False)
    model.down = Linear(8, 16, bias=False)
    model.lm_head = Linear(8, 100, bias=False)
    select_backend(CPU, F32, F32, BackendConfig()).prepare_weights(model)
    formats = (model.qkv.weight_format, model.down.weight_format, model.lm_head.weight_format)
    assert [fmt.max_rows for fmt in formats] == [24, 8, 4]


def test_an_unprepared_linear_says_what_to_do():
    with pytest.raises(RuntimeError, match="prepare_model"):
        Linear(4, 4, bias=False)(torch.ones(1, 4))


# ---------------------------------------------------------------------- calibration


def test_packed_max_rows_is_the_last_size_the_kernel_holds():
    choose = calibration.choose_packed_max_rows
    # (rows, packed s, torch s): the kernel holds while torch is not faster beyond the margin.
    timings = [(256, 1.0, 1.1), (512, 2.0, 2.0), (1024, 4.0, 3.5), (2048, 8.0, 9.0)]
    assert choose(timings, 0.03) == 512
    assert choose([(256, 1.0, 0.99), (512, 2.0, 1.95)], 0.03) == PACKED_MAX_ROWS
    assert choose([(128, 1.0, 0.8)], 0.03) == 64  # decode-sized batches stay on the kernel
    assert choose([], 0.03) == PACKED_MAX_ROWS


@kernels_built
def test_calibration_times_both_matmuls_once_per_shape_or_takes_the_setting(monkeypatch):
    weight = torch.randn(96, 64).bfloat16().float()
    packed = packing.pack_linear_weight(weight)
    assert MatmulCalibration(fixed_rows=300).packed_max_rows(weight, packed) == 300
    timed = MatmulCalibration(repeats=2)
    limit = timed.packed_max_rows(weight, packed)
    rows = calibration.CALIBRATION_ROWS
    assert limit in {rows[0] // 2, *rows[:-1], PACKED_MAX_ROWS}
    (shape,) = timed.report()["shapes"]
    assert shape["shape"] == [96, 64] and shape["max_rows"] == limit and shape["timings_ms"]
    # Once per shape: a second weight of the same shape gets the same answer without timing.
    monkeypatch.setattr(calibration, "_time_matmuls", lambda *args: pytest.fail("timed again"))
    assert timed.packed_max_rows(weight * 2, packed) == limit


def test_a_crossing_counts_only_if_a_second_timing_agrees(monkeypatch):
    weight, packed = torch.randn(80, 64), torch.empty(0)
    # (packed s, torch s) per call: torch "wins" at 8 once (a busy moment), then at 32 twice.
    timings = iter([(0.010, 0.005), (0.010, 0.010), (0.020, 0.020), (0.040, 0.030), (0.040, 0.030)])
    asked = []
    monkeypatch.setattr(
        calibration,
        "_time_matmuls",
        lambda w, p, rows, repeats: asked.append(rows) or next(timings),
    )
    assert calibration.CALIBRATION_ROWS[:3] == (8, 16, 32)
    assert MatmulCalibration().packed_max_rows(weight, packed) == 16
    assert asked == [8, 8, 16, 32, 32]


# ---------------------------------------------------------------------- layer ops


@kernels_built
def test_cpu_kernel_ops_match_torch_ops():
    gen = torch.Generator().manual_seed(1)
    kernel, torch_ops = CpuKernelOps(), TorchOps()
    weight = torch.randn(40, generator=gen)
    x, residual = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen)
    torch.testing.assert_close(
        kernel.rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5
    )
    x_in = x.clone()
    normed, summed = kernel.add_rms_norm(x_in, residual.clone(), weight, 1e-5)
    expected_normed, expected_sum = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected_normed, atol=1e-6, rtol=1e-5)
    assert normed.data_ptr() == x_in.data_ptr()  # computed in place
    qkv = torch.randn(4, 5 * 16, generator=gen)
    cos, sin = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    view = qkv[:, :48].view(4, 3, 16)
    expected = torch_ops.rotary(view, cos, sin)
    assert kernel.rotary(view, cos, sin).data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-5)
    gate_up = torch.randn(3, 2 * 24, generator=gen)
    torch.testing.assert_close(
        kernel.act_and_mul("silu")(gate_up),
        torch_ops.act_and_mul("silu")(gate_up),
        atol=1e-6,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="hidden_act='relu' is not supported"):
        kernel.act_and_mul("relu")
