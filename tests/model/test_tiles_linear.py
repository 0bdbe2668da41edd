"""bfloat16 weights in AMX tile order (cpu/packing.py's tile_weight, csrc/tiles_linear.cpp): the
layout, both kernels (AMX tiles, AVX512-BF16 dot products) against the exact product of their
bf16-rounded operands, the format taking the rows between the panels' limit and its own, the
calibration's choices, and the one-call decode layer over the tiles against the layer-by-layer
forward."""

from __future__ import annotations

import pytest
import torch

from octavo.model.backends import select
from octavo.model.cpu import build, calibration, fused, ops, packing
from octavo.model.cpu.calibration import MatmulCalibration
from octavo.model.formats.packed import PackedWeight

from .tiny import PagedHarness, load, save_tiny_checkpoint

bf16_dot = pytest.mark.skipif(
    not (build.load() and ops.bf16_tiles_available()),
    reason="no bfloat16 dot products on this CPU (avx512_bf16 in /proc/cpuinfo) or no CPU kernels",
)


def _exact_bf16_product(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product of x rounded to bfloat16 and w, and the bound float32 summation
    keeps to (a few float32 units of the sum of magnitudes)."""
    xr = x.to(torch.bfloat16).double()
    exact = xr @ w.double().T
    magnitude = xr.abs() @ w.double().abs().T
    return exact, 1e-6 * magnitude + 1e-30


@pytest.mark.parametrize("n, k", [(64, 32), (70, 50), (5, 3)])
def test_tile_order_puts_each_weight_where_the_tiles_read_it(n, k):
    weight = torch.randn(n, k).bfloat16()
    tiled = packing.tile_weight(weight)
    assert tiled.shape == packing.tiled_shape(weight) and tiled.dtype == torch.bfloat16
    groups, slices = tiled.shape[:2]
    for g, s, h, p, c, e in [(0, 0, 0, 0, 0, 1), (groups - 1, slices - 1, 1, 15, 15, 1)]:
        row, col = 32 * g + 16 * h + c, 32 * s + 2 * p + e
        expected = weight[row, col] if row < n and col < k else 0
        assert tiled[g, s, h, p, c, e] == expected
    # Every weight once, zeros elsewhere; the `out` form writes the same.
    whole = tiled.permute(0, 2, 4, 1, 3, 5).reshape(groups * 32, slices * 32)
    assert torch.equal(whole[:n, :k], weight)
    assert not whole[n:].any() and not whole[:, k:].any()
    out = torch.full(packing.tiled_shape(weight), 7.0, dtype=torch.bfloat16)
    assert torch.equal(packing.tile_weight(weight, out=out), tiled)


@bf16_dot
@pytest.mark.parametrize("n, k", [(96, 64), (100, 72), (33, 576), (3, 16)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False])
def test_tiles_linear_is_the_product_of_the_bf16_rounded_operands(n, k, x_dtype, amx):
    """Both kernels: AMX where the CPU has the tiles (else both runs take the dot products)."""
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    tiled = packing.tile_weight(weight)
    for rows in (0, 1, 11, 12, 13, 15, 16, 17, 32, 33, 70):
        x = torch.randn(rows, k, generator=gen).to(x_dtype)
        got = ops.tiles_linear(x, tiled, n, amx=amx)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        exact, bound = _exact_bf16_product(x, weight)
        assert ((got.double() - exact).abs() <= bound).all(), (rows, n, k)


@bf16_dot
def test_the_format_takes_the_rows_between_the_panels_limit_and_its_own(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen)
    fmt = PackedWeight(weight, packing.pack_linear_weight(weight), max_rows=4)
    plain_bytes = fmt.nbytes
    fmt.tiles, fmt.tiles_max_rows = packing.tile_weight(weight), 16
    assert fmt.nbytes == plain_bytes + fmt.tiles.numel() * 2
    calls = []
    tiles_linear = ops.tiles_linear
    monkeypatch.setattr(
        ops, "tiles_linear", lambda *a: calls.append(a[0].shape[0]) or tiles_linear(*a)
    )
    for rows in (3, 4, 5, 16, 17, 40):
        x = torch.randn(rows, 64, generator=gen)
        got = fmt.matmul(x, bias)
        exact, bound = _exact_bf16_product(x, weight)
        if rows <= 4:  # the panels: float32 x, not rounded
            exact = x.double() @ weight.double().T
        elif rows > 16:  # torch's GEMM: a bfloat16 result
            bound = bound + 2**-8 * exact.abs()
        assert ((got.double() - bias.double() - exact).abs() <= bound + 1e-5).all(), rows
    assert calls == [5, 16]


def test_the_calibration_keeps_the_tiles_up_to_where_the_gemm_overtakes(monkeypatch):
    # (tiles s, GEMM s) per size of BF16_TILES_CALIBRATION_ROWS: ahead to 64, behind at 128
    # (twice: a crossing is timed again before it counts).
    answers = iter([(1e-3, 2e-3)] * 3 + [(3e-3, 2e-3)] * 2)
    timed_rows = []

    def fake_timed_pair(kernel, other, k, dtype, repeats):
        return lambda rows: timed_rows.append(rows) or next(answers)

    monkeypatch.setattr(calibration, "_timed_pair", fake_timed_pair)
    weight = torch.zeros(64, 32, dtype=torch.bfloat16)
    fmt = PackedWeight(weight, packing.pack_linear_weight(weight), max_rows=8)
    timed = MatmulCalibration()
    assert timed.bf16_tiles_max_rows(fmt) == 64
    assert timed.bf16_tiles_max_rows(fmt) == 64  # once per shape
    assert timed_rows == [16, 32, 64, 128, 128]
    (shape,) = timed.report()["shapes"]
    assert shape["format"] == "bf16 tiles" and shape["max_rows"] == 64
    # Ahead at every size timed: no further than the largest (prompt sizes stay the GEMM's).
    answers = iter([(1e-3, 2e-3)] * 4)
    other = torch.zeros(96, 32, dtype=torch.bfloat16)
    wider = PackedWeight(other, packing.pack_linear_weight(other), max_rows=8)
    assert timed.bf16_tiles_max_rows(wider) == calibration.BF16_TILES_CALIBRATION_ROWS[-1]
    # The fixed setting names one limit: no tiles.
    assert MatmulCalibration(fixed_rows=8).bf16_tiles_max_rows(fmt) == 0


def test_the_panels_keep_the_rows_below_the_first_size_at_which_the_tiles_are_faster(
    monkeypatch,
):
    # (panels s, tiles s) per size of PANELS_VS_TILES_ROWS: level at 2 and 4 rows, the tiles
    # faster at 8 (twice: a crossing is timed again before it counts).
    answers = iter([(1e-3, 1e-3)] * 2 + [(2e-3, 1e-3)] * 2)
    timed_rows = []

    def fake_timed_pair(kernel, other, k, dtype, repeats):
        return lambda rows: timed_rows.append(rows) or next(answers)

    monkeypatch.setattr(calibration, "_timed_pair", fake_timed_pair)

    def tiled_format(n: int, max_rows: int) -> PackedWeight:
        weight = torch.zeros(n, 32, dtype=torch.bfloat16)
        fmt = PackedWeight(weight, packing.pack_linear_weight(weight), max_rows=max_rows)
        fmt.tiles, fmt.tiles_max_rows = packing.tile_weight(weight), 128
        return fmt

    timed = MatmulCalibration()
    fmt = tiled_format(64, max_rows=32)
    assert timed.panels_before_tiles(fmt) == 4
    assert timed_rows == [2, 4, 8, 8]
    shapes = {s["format"]: s for s in timed.report()["shapes"]}
    assert shapes["panels vs bf16 tiles"]["max_rows"] == 4
    # The tiles faster at 2 rows already: the panels keep one row.
    answers = iter([(2e-3, 1e-3)] * 2)
    assert timed.panels_before_tiles(tiled_format(96, max_rows=32)) == 1
    # Never above the limit against the GEMM, and only sizes up to it are timed.
    timed_rows.clear()
    answers = iter([(1e-3, 2e-3)] * 2)
    assert timed.panels_before_tiles(tiled_format(128, max_rows=4)) == 4
    assert timed_rows == [2, 4]
    # No tiles, or the fixed setting: the limit as it was, nothing timed.
    plain = tiled_format(160, max_rows=16)
    plain.tiles = None
    assert timed.panels_before_tiles(plain) == 16
    assert MatmulCalibration(fixed_rows=8).panels_before_tiles(tiled_format(192, 8)) == 8
    assert timed_rows == [2, 4]


@bf16_dot
def test_the_one_call_layer_multiplies_by_the_tiles_between_the_limits(tmp_path):
    """bfloat16 weights under float32 compute, the panels' limit fixed at 2 rows: every
    projection is given tiles up to 8 rows, one projection's tiles made of other values on
    purpose. A 3-row decode step of the one-call layer gives the layer-by-layer forward's
    logits bit for bit, and not those of the same model without the tiles."""
    save_tiny_checkpoint(tmp_path, "llama", seed=4)
    model, backend = load(tmp_path, max_rows=2, weight_dtype=torch.bfloat16)
    assert backend.fused_decode_layer == "on"
    formats = [m.weight_format for m in model.modules() if hasattr(m, "weight_format")]
    assert formats and all(isinstance(f, PackedWeight) for f in formats)
    for fmt in formats:
        fmt.tiles, fmt.tiles_max_rows = packing.tile_weight(fmt.weight), 8
    o_proj = model.model.layers[0].self_attn.o_proj.weight_format
    o_proj.tiles = packing.tile_weight(o_proj.weight * 2)
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
    for fmt in formats:
        fmt.tiles, fmt.tiles_max_rows = None, 0
    plain = PagedHarness(model, backend, seed=3)
    decode = [plain.step(scheduled) for scheduled in steps][1]
    assert not torch.allclose(decode["a"], fused_logits[1]["a"], atol=1e-3)


@bf16_dot
def test_a_timed_load_gives_bf16_weights_tiles_and_counts_their_bytes(tmp_path, monkeypatch):
    """Without a fixed limit (the session's fixture fixes one; undone here) the backend times
    the tiles per shape; wherever it keeps them their limit is above the panels', their bytes
    are in the weights report, and they hold the weight in tile order."""
    monkeypatch.setattr(select, "MatmulCalibration", MatmulCalibration)
    save_tiny_checkpoint(tmp_path, "llama", seed=4)
    model, backend = load(tmp_path, weight_dtype=torch.bfloat16)
    formats = [
        getattr(m, "weight_format", None) or m.head_format
        for m in model.modules()
        if hasattr(m, "weight_format") or getattr(m, "head_format", None) is not None
    ]
    tiled = [f for f in formats if f.tiles is not None]
    assert backend.weights_report["tiles_bytes"] == sum(f.tiles.numel() * 2 for f in tiled)
    for fmt in tiled:
        assert fmt.tiles_max_rows > fmt.max_rows >= 1
        assert torch.equal(fmt.tiles, packing.tile_weight(fmt.weight))
    shapes = backend.weights_report["matmul_calibration"]["shapes"]
    assert any(s["format"] == "bf16 tiles" for s in shapes)
    if tiled:
        # The panels were timed against the tiles, and keep no row past that limit.
        against_tiles = {
            tuple(s["shape"]): s["max_rows"]
            for s in shapes
            if s["format"] == "panels vs bf16 tiles"
        }
        for fmt in tiled:
            assert fmt.max_rows <= against_tiles[tuple(fmt.weight.shape)]


@bf16_dot
def test_decodes_over_a_bf16_cache_take_the_bf16_products_in_both_layer_paths(tmp_path):
    """Over a bfloat16 cache the backend decodes with paged_decode_attention's bfloat16
    products (head size 64 here, which the kernel has them for), in the one-call layer as in
    the layer-by-layer forward: the same logits bit for bit, and not those of the float
    decode kernel on the same cache."""
    save_tiny_checkpoint(tmp_path, "llama", seed=6, hidden_size=128, num_attention_heads=2)
    model, backend = load(tmp_path, kv_cache_dtype=torch.bfloat16, max_rows=2)
    assert backend.fused_decode_layer == "on" and backend.attention.decode_bf16
    assert backend.attention.choices()["decode_attention"].startswith("avx512_bf16")
    prompts = {"a": [5, 9, 2, 7, 4], "b": [3, 8, 1, 6, 6, 2], "c": [7, 7, 1]}
    steps = [prompts] + [{r: [11 + i + s] for i, r in enumerate(prompts)} for s in range(3)]

    def run() -> list[dict]:
        harness = PagedHarness(model, backend, seed=3)
        return [harness.step(scheduled) for scheduled in steps]

    one_call = run()
    model.model.fused_decode = None
    layer_by_layer = run()
    for got, expected in zip(layer_by_layer, one_call, strict=True):
        assert all(torch.equal(got[r], expected[r]) for r in got)
    backend.attention.decode_bf16 = False
    floats = run()
    assert torch.equal(floats[0]["a"], one_call[0]["a"])  # the prompts: the same kernel
    assert not torch.equal(floats[1]["a"], one_call[1]["a"])
    torch.testing.assert_close(floats[1]["a"], one_call[1]["a"], atol=0.05, rtol=0)
