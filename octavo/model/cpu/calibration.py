"""Which matmul takes a batch of a given size: the packed kernel or torch's GEMM, measured.

Where the two cross depends on the CPU and the weight's shape (benchmarks/history/,
"Prompt-sized matmuls"): level or ahead up to 2,048 rows on an AVX2 AMD EPYC; on an AVX-512
Intel Xeon ahead up to ~256 rows for most shapes and 5-15% behind MKL beyond; on an Intel Xeon
with AMX, whose bfloat16 GEMM (oneDNN's, through torch) runs on the tile units, behind from 16
to 32 rows on. So when a model is loaded each weight shape is timed once
(`MatmulCalibration`), and the result is part of the start-up configuration. Knows nothing of
models: weights and their packed copies come in as tensors.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.model.cpu import onednn, ops, packing

logger = logging.getLogger(__name__)

# Rows up to which packed_linear is used where nothing was measured: the output projection,
# which only sees sampled rows, and a fixed setting's default.
PACKED_MAX_ROWS = 4096
# The batch sizes timed, smallest first; how much faster torch must be to take a size (timings
# on a shared machine wobble by a few percent); and the time of one call beyond which larger
# sizes are not timed (a large model's weights would take minutes).
CALIBRATION_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
CALIBRATION_MARGIN = 0.03
CALIBRATION_MAX_CALL_S = 0.05


def choose_packed_max_rows(timings: list[tuple[int, float, float]], margin: float) -> int:
    """The row limit for packed_linear from (rows, packed seconds, torch seconds), ascending in
    rows: the largest size before the first at which torch's GEMM is faster by more than
    `margin`; PACKED_MAX_ROWS if it never is. Below the smallest size timed the kernel is kept
    (half of it), as decode-sized batches are what it is for."""
    limit = 0
    for rows, packed_s, torch_s in timings:
        if torch_is_faster(packed_s, torch_s, margin):
            return limit or rows // 2
        limit = rows
    return PACKED_MAX_ROWS


def torch_is_faster(packed_s: float, torch_s: float, margin: float = CALIBRATION_MARGIN) -> bool:
    return torch_s * (1 + margin) < packed_s


def time_interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each named function over `repeats` rounds that run them all in
    turn, so that the machine's drift hits every one alike (one warm-up call each first)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(max(repeats, 1)):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


# The batch sizes at which a weight's copy reordered for oneDNN is timed against torch's GEMM
# on the plain weight: a decode batch above the packed kernel's limit and a prompt chunk.
ONEDNN_CALIBRATION_ROWS = (32, 256)
# The batch sizes timed for a weight in GGML blocks: the block kernel's integer dot products
# against dequantizing the weight for the call and torch's GEMM.
QUANT_CALIBRATION_ROWS = (8, 16, 32, 64, 128, 256)
# The batch sizes timed for the AMX tile kernel against dequantizing the weight for the call.
TILES_CALIBRATION_ROWS = (64, 128, 256, 512, 1024, 2048)
# The batch sizes timed for a bfloat16 weight's copy in AMX tile order against torch's GEMM:
# decode batches. The tiles take no more rows than the largest size timed: at prompt sizes
# oneDNN's GEMM runs near the tile units' rate while the tile kernel stays level at 256 rows
# and falls behind above, which timings of one weight hot in cache do not show.
BF16_TILES_CALIBRATION_ROWS = (16, 32, 64, 128)
# The batch sizes at which the panels are timed against the tiles, once a weight has both: the
# panels keep the rows below the first size at which the tiles are faster (on a Zen 4 from 4
# rows on: float32 FMAs against bfloat16 pair dot products, twice the products an
# instruction; level at 1 row, where both read the weight at the memory's rate).
PANELS_VS_TILES_ROWS = (2, 4, 8, 16, 32, 64, 128)


def _timed_pair(
    kernel: Callable[[Tensor], Tensor],
    other: Callable[[Tensor], Tensor],
    k: int,
    dtype: torch.dtype,
    repeats: int,
) -> Callable[[int], tuple[float, float]]:
    """timed(rows) -> best-of-`repeats` seconds of kernel(x) and other(x) for `rows` random
    rows of k values, alternated."""

    def timed(rows: int) -> tuple[float, float]:
        x = torch.randn(rows, k, dtype=dtype)
        times = time_interleaved({"kernel": lambda: kernel(x), "other": lambda: other(x)}, repeats)
        return min(times["kernel"]), min(times["other"])

    return timed


def _time_matmuls(weight: Tensor, packed: Tensor, rows: int, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of packed_linear and of F.linear for `rows` rows, alternated so
    that a slow moment of the machine hits both."""
    n, k = weight.shape
    packed_matmul = functools.partial(ops.packed_linear, packed=packed, n=n)
    torch_matmul = functools.partial(F.linear, weight=weight)
    return _timed_pair(packed_matmul, torch_matmul, k, weight.dtype, repeats)(rows)


class MatmulCalibration:
    """Per weight shape, the row limit up to which the packed kernel takes a matmul.

    Owned by a backend for its process; layers of one shape are timed once. With `fixed_rows`
    (the `packed_max_rows` setting) nothing is timed and every shape gets that limit. `report()`
    is what the start-up configuration shows.
    """

    def __init__(self, fixed_rows: int | None = None, repeats: int = 5) -> None:
        self.fixed_rows = fixed_rows
        self.repeats = repeats
        self._limits: dict[tuple, int] = {}
        self._timings: dict[tuple, list[tuple[int, float, float]]] = {}
        self._onednn: dict[tuple, bool] = {}

    def packed_max_rows(self, weight: Tensor, packed: Tensor) -> int:
        """The row limit for this weight (a CPU compute weight, as torch's GEMM gets it) and its
        packed copy: both timed at CALIBRATION_ROWS, smallest first, until torch's is faster (in
        two timings running) or one call takes longer than CALIBRATION_MAX_CALL_S, then
        `choose_packed_max_rows`. ~0.3 s for each of the embedded model's four shapes on two
        cores. torch's GEMM is timed on the plain weight even where a copy reordered for
        oneDNN takes the rows above the limit: the copy is faster in the calibration's
        repeated calls on one weight, but a decode step reads each weight once, from far
        caches, where the packed kernel's streaming keeps its lead (decode steps of 8 rows
        slower by a sixth with the limit set against the copy)."""
        if self.fixed_rows is not None:
            return self.fixed_rows
        key = (tuple(weight.shape), weight.dtype, packed.dtype, torch.get_num_threads())
        return self._limit(
            key,
            CALIBRATION_ROWS,
            lambda rows: _time_matmuls(weight, packed, rows, self.repeats),
            f"{weight.shape[0]} x {weight.shape[1]} weight: packed matmul",
            "torch's GEMM",
        )

    def onednn_faster(self, weight: Tensor, onednn_weight: Tensor) -> bool:
        """Whether oneDNN's linear on the reordered copy (model/cpu/onednn.py) is faster than
        torch's GEMM on the plain weight: both timed at ONEDNN_CALIBRATION_ROWS, the copy taken
        where it is faster at every size. Under the fixed setting it is taken wherever it
        exists (nothing is timed). Once per shape."""
        if self.fixed_rows is not None:
            return True
        key = (tuple(weight.shape), weight.dtype, "onednn", torch.get_num_threads())
        if key not in self._onednn:
            timed = _timed_pair(
                functools.partial(onednn.linear, packed=onednn_weight),
                functools.partial(F.linear, weight=weight),
                weight.shape[1],
                weight.dtype,
                self.repeats,
            )
            timings = [(rows, *timed(rows)) for rows in ONEDNN_CALIBRATION_ROWS]
            faster = all(onednn_s < plain_s for _, onednn_s, plain_s in timings)
            self._onednn[key] = faster
            self._timings[key] = timings
            logger.info(
                "%d x %d weight: %s (%s)",
                weight.shape[0],
                weight.shape[1],
                "oneDNN's linear on a reordered copy" if faster else "torch's GEMM",
                ", ".join(f"{r} rows {p * 1e3:.2f} vs {q * 1e3:.2f} ms" for r, p, q in timings),
            )
        return self._onednn[key]

    def quant_max_rows(self, fmt: Any) -> int:
        """The row limit for a formats.quantized.QuantizedWeight: its block kernel against what
        takes the rows above it (the AMX tile kernel where the weight has it, else dequantize-
        then-GEMM, its gemm_matmul), timed at QUANT_CALIBRATION_ROWS smallest first until that
        is faster (in two timings running), as packed_max_rows. The fixed setting applies here
        too."""
        if self.fixed_rows is not None:
            return self.fixed_rows
        t = fmt.tensor
        above = fmt.tiles_matmul if fmt.tiles else fmt.gemm_matmul
        return self._limit(
            (tuple(t.shape), t.qtype.name, fmt.dtype, torch.get_num_threads()),
            QUANT_CALIBRATION_ROWS,
            _timed_pair(fmt.kernel_matmul, above, t.shape[1], fmt.dtype, self.repeats),
            f"{t.shape[0]} x {t.shape[1]} {t.qtype.name} weight: block kernel",
            "AMX tiles" if fmt.tiles else "dequantized GEMM",
        )

    def quant_tiles_max_rows(self, fmt: Any) -> int:
        """The row limit of the AMX tile kernel for a QuantizedWeight that has it (`tiles`),
        against dequantize-then-GEMM, timed at TILES_CALIBRATION_ROWS as quant_max_rows; 0
        where the weight has no tiles or under the fixed setting (which names one limit)."""
        if self.fixed_rows is not None or not fmt.tiles:
            return 0
        t = fmt.tensor
        return self._limit(
            (tuple(t.shape), f"{t.qtype.name} tiles", fmt.dtype, torch.get_num_threads()),
            TILES_CALIBRATION_ROWS,
            _timed_pair(fmt.tiles_matmul, fmt.gemm_matmul, t.shape[1], fmt.dtype, self.repeats),
            f"{t.shape[0]} x {t.shape[1]} {t.qtype.name} weight: AMX tiles",
            "dequantized GEMM",
        )

    def bf16_tiles_max_rows(self, fmt: Any) -> int:
        """The row limit of tiles_linear on a copy of the PackedWeight `fmt`'s bfloat16 weight
        in tile order (a scratch one, made once per shape) against the format's GEMM above its
        panels (on the oneDNN copy where it has one), timed at BF16_TILES_CALIBRATION_ROWS as
        packed_max_rows, and no further than the largest of them; 0 under the fixed setting
        (which names one limit). Timed with the weight hot in cache, which favours the GEMM: a
        decode step reads each weight once from memory, where the tiles' lead is larger
        (BENCHMARKS.md, 2026-12-06)."""
        if self.fixed_rows is not None:
            return 0
        weight = fmt.weight
        tiles = functools.cache(lambda: packing.tile_weight(weight))

        def tiles_matmul(x: Tensor) -> Tensor:
            return ops.tiles_linear(x, tiles(), weight.shape[0])

        return self._limit(
            (tuple(weight.shape), "bf16 tiles", weight.dtype, torch.get_num_threads()),
            BF16_TILES_CALIBRATION_ROWS,
            _timed_pair(
                tiles_matmul,
                fmt.gemm_matmul,
                weight.shape[1],
                torch.float32,
                self.repeats,
            ),
            f"{weight.shape[0]} x {weight.shape[1]} weight: bf16 tiles",
            "torch's GEMM",
            capped=True,
        )

    def panels_before_tiles(self, fmt: Any) -> int:
        """The panels' row limit for a PackedWeight that has its tile-order copy (`tiles`):
        its limit against the GEMM, lowered to the last of PANELS_VS_TILES_ROWS before the
        first at which the tiles are faster (1 where they are faster at 2 rows already)."""
        if self.fixed_rows is not None or fmt.tiles is None:
            return fmt.max_rows
        weight = fmt.weight
        sizes = tuple(r for r in PANELS_VS_TILES_ROWS if r <= fmt.max_rows) or (fmt.max_rows,)
        limit = self._limit(
            (tuple(weight.shape), "panels vs bf16 tiles", weight.dtype, torch.get_num_threads()),
            sizes,
            _timed_pair(
                fmt.panels_matmul, fmt.tiles_matmul, weight.shape[1], torch.float32, self.repeats
            ),
            f"{weight.shape[0]} x {weight.shape[1]} weight: packed panels",
            "bf16 tiles",
        )
        return max(1, min(fmt.max_rows, limit))

    def _limit(
        self,
        key: tuple,
        sizes: tuple[int, ...],
        timed: Callable[[int], tuple[float, float]],
        kernel: str,
        other: str,
        capped: bool = False,
    ) -> int:
        """The row limit of `key`, timing (kernel seconds, torch seconds) = timed(rows) at
        `sizes`, smallest first, until torch's is faster (in two timings running) or one call
        takes longer than CALIBRATION_MAX_CALL_S; then choose_packed_max_rows. Once per key."""
        if key not in self._limits:
            timings = []
            for rows in sizes:
                kernel_s, torch_s = timed(rows)
                if torch_is_faster(kernel_s, torch_s):
                    # A busy moment can fake a crossing: the second timing decides.
                    kernel_s, torch_s = timed(rows)
                timings.append((rows, kernel_s, torch_s))
                if torch_is_faster(kernel_s, torch_s) or kernel_s > CALIBRATION_MAX_CALL_S:
                    break
            limit = choose_packed_max_rows(timings, CALIBRATION_MARGIN)
            # Capped: never beyond the sizes timed.
            self._limits[key] = min(limit, sizes[-1]) if capped else limit
            self._timings[key] = timings
            logger.info(
                "%s up to %d rows, %s above (%s)",
                kernel,
                self._limits[key],
                other,
                ", ".join(f"{r} rows {p * 1e3:.2f} vs {q * 1e3:.2f} ms" for r, p, q in timings),
            )
        return self._limits[key]

    def report(self) -> dict[str, Any]:
        """Plain data for the start-up configuration: the fixed limit, or each shape's limit
        with the timings (ms) it was chosen from."""
        if self.fixed_rows is not None:
            return {"fixed_max_rows": self.fixed_rows}
        shapes = []
        for key, timings in self._timings.items():
            shape, first, second, _ = key
            # The packed copy's dtype, the GGML block type, or "onednn" (the reordered copy
            # against the plain weight).
            kind = first if isinstance(first, str) else second
            entry: dict[str, Any] = {
                "shape": list(shape),
                "format": kind if isinstance(kind, str) else str(kind).removeprefix("torch."),
            }
            if key in self._limits:
                entry["max_rows"] = self._limits[key]
            else:
                entry["chosen"] = self._onednn[key]
            entry["timings_ms"] = [
                [rows, round(p * 1e3, 3), round(t * 1e3, 3)] for rows, p, t in timings
            ]
            shapes.append(entry)
        return {"shapes": shapes}
