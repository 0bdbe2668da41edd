"""select_backend: the one place that decides which implementation runs each part of a model.

Called once when the engine's worker is built, with the device, the compute and cache dtypes and
the backend settings (octavo.config.BackendConfig). The rules:

    device  compute   cache        kernels  attention   layer ops    weights   draw    fused
    cpu     float32   f32 / bf16   loaded   cpu_paged   cpu_kernels  packed    kernel  opt-in
    cpu     bf16      f32 / bf16   loaded   cpu_paged   torch        packed    kernel  -
    cpu     any       float16      loaded   sdpa        (as above)   packed*   kernel  -
    cpu     any       any          off      sdpa        torch        dense     torch   -
    other   any       any          -        sdpa        torch        dense     torch   -
    (* float32 and bfloat16 weights; float16 ones stay dense)
    (draw: the sampler's random draw and its greedy pick, the kernels' where they are
    vectorised, else torch's)

`attention_backend` other than "auto" overrides the attention column (the tests compare every
backend with "reference" this way); asking for cpu_paged where it cannot run is a ValueError.
A GPU backend is one more module and one more row here. `ModelBackend.describe()` is what the
start-up configuration logs of the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from octavo.config import ATTENTION_BACKENDS, BackendConfig
from octavo.model import memory
from octavo.model.backends.base import AttentionBackend, LayerOps
from octavo.model.backends.reference import ReferenceAttention
from octavo.model.backends.sdpa import SdpaAttention
from octavo.model.backends.torch_ops import TorchOps
from octavo.model.cpu import build, fused, onednn, packing
from octavo.model.cpu import ops as cpu_ops
from octavo.model.cpu.calibration import MatmulCalibration
from octavo.model.formats import DenseWeight, LinearWeight
from octavo.model.formats.base import ConcatWeight
from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.formats.packed import PackedWeight
from octavo.model.formats.quantized import QUANT_MAX_ROWS, QuantizedWeight
from octavo.model.layers.embedding import VocabEmbedding
from octavo.model.layers.linear import Linear, PackedLinear

logger = logging.getLogger(__name__)


@dataclass
class ModelBackend:
    """The implementations one engine's model runs with, chosen by select_backend."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    attention: AttentionBackend
    ops: LayerOps
    # The sampler's random draw (Sampler(draw=...)); None: softmax and torch's search.
    draw: Callable[[Tensor, Tensor], Tensor] | None
    # Whether the CPU kernels are loaded: linear weights get packed copies, and the fused
    # decode layer may run where the compute dtype is float32 and attention is cpu_paged.
    kernels: bool
    huge_pages: bool
    calibration: MatmulCalibration | None
    # Whether block weights dequantized for large batches multiply in bfloat16 (BackendConfig).
    bf16_dequantized_gemm: bool = False
    # Why the kernels are off ("" when on).
    kernels_off_reason: str = ""
    # The sampler's greedy pick (Sampler(argmax=...)); None: torch's argmax.
    argmax: Callable[[Tensor], Tensor] | None = None
    # The float weight matrices' (linear layers', embeddings') dtype where it is not the compute
    # dtype; their GEMMs then run in it, the activations cast to it (formats/base.py).
    weight_dtype: torch.dtype | None = None
    # Filled by prepare_model: what the weights became and whether the fused layer runs.
    weights_report: dict[str, Any] = field(default_factory=dict)
    fused_decode_layer: str = "off: not prepared"

    def prepare_model(self, model: nn.Module) -> None:
        """After the weights are loaded: give every Linear (and a tied embedding used as the
        output projection) its weight format, then bind the fused decode layer where it is
        compatible. Mutates the model's modules; call once per model."""
        self.weights_report = self.prepare_weights(model)
        reason = self._fused_incompatibility(model)
        if reason is None:
            model.model.fused_decode = fused.bind(model)
            self.fused_decode_layer = "on"
        else:
            self.fused_decode_layer = f"off: {reason}"

    def _fused_incompatibility(self, model: nn.Module) -> str | None:
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            return "tensor parallelism (the one-call layer has no all-reduce)"
        if not self.kernels:
            return "no CPU kernels"
        if self.dtype != torch.float32:
            return f"compute dtype {str(self.dtype).removeprefix('torch.')} (float32 only)"
        if self.attention.name != "cpu_paged":
            return f"attention backend {self.attention.name}"
        return fused.incompatibility(model)

    def prepare_weights(self, model: nn.Module) -> dict[str, Any]:
        """Give every Linear of `model` its weight format (and a VocabEmbedding its head
        format): GGML blocks where the checkpoint's weight came in a block type (its float
        parameter then released), else packed where the kernels are loaded and the dtype
        allows, else dense. Returns what they became (counts per format, bytes by type, bytes
        of packed copies, the calibration)."""
        targets = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, (Linear, VocabEmbedding))
        ]
        quantized = {name: self._quantized_format(module) for name, module in targets}
        quantized = {name: fmt for name, fmt in quantized.items() if fmt is not None}
        layouts = {}
        if self.kernels:
            for name, module in targets:
                layout = None if name in quantized else packing.packed_layout(module.weight)
                if layout is not None:
                    layouts[name] = layout
        # The packed copies share one allocation in huge pages: a decode step streams all of
        # them, and with 4 KiB pages the TLB misses cost several percent of the batch-1
        # matmuls' time (benchmarks/history/, "Decode attention in sixteen lanes, huge
        # pages, 128-token blocks").
        slots = dict(
            zip(layouts, memory.empty_many(list(layouts.values()), huge_pages=self.huge_pages))
        )
        for name, module in targets:
            if name in quantized:
                fmt = quantized[name]
            elif name in slots:
                packed = packing.pack_linear_weight(module.weight, out=slots[name])
                max_rows = self.calibration.packed_max_rows(module.weight, packed)
                fmt = PackedWeight(module.weight, packed, max_rows)
                fmt.onednn_weight = self._onednn_copy(module.weight)
            else:
                fmt = DenseWeight(module.weight)
                fmt.onednn_weight = self._onednn_copy(module.weight)
            if isinstance(module, Linear):
                module.weight_format = fmt
            else:
                module.head_format = fmt
        prepared = [
            module.weight_format if isinstance(module, Linear) else module.head_format
            for _, module in targets
        ]
        tiles_bytes = self._tile_copies([f for f in prepared if isinstance(f, PackedWeight)])
        formats: dict[str, int] = {}
        for fmt in prepared:
            formats[fmt.name] = formats.get(fmt.name, 0) + 1
        packed_bytes = sum(s.numel() * s.element_size() for s in slots.values())
        onednn_copies = [
            fmt.onednn_weight
            for fmt in prepared
            if isinstance(fmt, DenseWeight) and fmt.onednn_weight is not None
        ]
        onednn_bytes = sum(onednn.nbytes(copy) for copy in onednn_copies)
        report: dict[str, Any] = {
            "formats": formats,
            "bytes_by_type": weight_bytes_by_type(model),
            "packed_bytes": packed_bytes,
            "onednn_bytes": onednn_bytes,
            "tiles_bytes": tiles_bytes,
        }
        if slots or quantized:
            report["matmul_calibration"] = self.calibration.report() if self.calibration else {}
        if slots:
            logger.info(
                "packed %d weights for decode-sized matmuls (%.0f MiB more; %s)",
                len(slots),
                packed_bytes / 2**20,
                ", ".join(f"{n} {name}" for name, n in sorted(formats.items())),
            )
        if onednn_copies:
            logger.info(
                "reordered %d weights for oneDNN's linear (%.0f MiB more), measured faster "
                "than torch's GEMM on the plain weight",
                len(onednn_copies),
                onednn_bytes / 2**20,
            )
        return report

    def _tile_copies(self, packed: list[PackedWeight]) -> int:
        """Give the bfloat16 PackedWeights a copy in AMX tile order (packing.tile_weight) where
        the CPU has bfloat16 dot products (AMX tiles or AVX512-BF16) and the calibration finds
        them faster than the GEMM above the panels' limit; the panels then keep only the rows
        at which they beat the tiles too (the panels' float32 FMAs are exact, the tiles round
        x to bfloat16 as the GEMM does). The copies share one allocation in huge pages, as the
        panels do. Returns their bytes."""
        if self.calibration is None or not cpu_ops.bf16_tiles_available():
            return 0
        chosen: list[tuple[PackedWeight, int]] = []
        for fmt in packed:
            if fmt.weight.dtype != torch.bfloat16:
                continue
            limit = self.calibration.bf16_tiles_max_rows(fmt)
            if limit > fmt.max_rows:
                chosen.append((fmt, limit))
        if not chosen:
            return 0
        layouts = [(packing.tiled_shape(fmt.weight), torch.bfloat16) for fmt, _ in chosen]
        copies = memory.empty_many(layouts, huge_pages=self.huge_pages)
        for (fmt, limit), copy in zip(chosen, copies):
            fmt.tiles = packing.tile_weight(fmt.weight, out=copy)
            fmt.tiles_max_rows = limit
            fmt.max_rows = self.calibration.panels_before_tiles(fmt)
        nbytes = sum(c.numel() * c.element_size() for c in copies)
        logger.info(
            "laid out %d bfloat16 weights in tile order for %d-%d-row matmuls on %s "
            "(%.0f MiB more), measured faster than torch's GEMM",
            len(chosen),
            min(fmt.max_rows for fmt, _ in chosen) + 1,
            max(limit for _, limit in chosen),
            "AMX tiles" if cpu_ops.amx_tiles_available() else "AVX512-BF16 dot products",
            nbytes / 2**20,
        )
        return nbytes

    def _onednn_copy(self, weight: Tensor) -> Tensor | None:
        """The weight reordered for oneDNN's linear (model/cpu/onednn.py) where the kernels are
        loaded, oneDNN takes its dtype here and the calibration measures it faster than
        torch's GEMM on the plain weight; else None."""
        if self.calibration is None or not onednn.available(weight):
            return None
        copy = onednn.prepack(weight)
        return copy if self.calibration.onednn_faster(weight, copy) else None

    def _quantized_format(self, module: Linear | VocabEmbedding) -> LinearWeight | None:
        """The format of a weight that came (wholly or in part) as GGML blocks, or None. Its
        blocks are copied into memory of the engine's own (one allocation, in huge pages
        where the system gives them) and the module's float parameter is released."""
        parts = module.weight_parts()
        if parts is None:
            return None
        # Runs of shards in one block type become one weight, their rows concatenated.
        runs: list[list[QuantizedTensor | Tensor]] = []
        for part in parts:
            if runs and _same_kind(runs[-1][-1], part):
                runs[-1].append(part)
            else:
                runs.append([part])
        formats: list[LinearWeight] = []
        for run in runs:
            if not isinstance(run[0], QuantizedTensor):
                formats.append(DenseWeight(torch.cat(run).clone()))
                continue
            n, k = sum(t.shape[0] for t in run), run[0].shape[1]
            qtype = run[0].qtype
            source = torch.cat([t.blocks for t in run])
            kernel_type = None
            if self.kernels and cpu_ops.quant_repacked_type(qtype) != qtype:
                # The kernels' own arrangement of the same bytes (model/cpu/ops.py).
                kernel_type = cpu_ops.quant_repacked_type(qtype)
                source = cpu_ops.quant_repack(source, qtype, k)
            blocks = memory.empty(tuple(source.shape), torch.uint8, self.device, self.huge_pages)
            blocks.copy_(source)
            del source
            tensor = QuantizedTensor(blocks, qtype, (n, k))
            gemm_dtype = torch.bfloat16 if self.bf16_dequantized_gemm else None
            fmt = QuantizedWeight(
                tensor, self.dtype, self.kernels, QUANT_MAX_ROWS, kernel_type, gemm_dtype
            )
            if self.calibration is not None:
                fmt.max_rows = self.calibration.quant_max_rows(fmt)
                fmt.tiles_max_rows = self.calibration.quant_tiles_max_rows(fmt)
            formats.append(fmt)
        # The float parameter and the loaded blocks (a file's map, or a quantized checkpoint's
        # copy) go; the module keeps the blocks it now computes with.
        weight = module.weight
        module.weight = nn.Parameter(
            torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
        )
        if isinstance(module, PackedLinear):
            module.quantized_shards = {}
        else:
            module.quantized = formats[0].tensor
        return formats[0] if len(formats) == 1 else ConcatWeight(formats)

    def describe(self) -> dict[str, Any]:
        """The choices as plain data, for the start-up configuration JSON."""
        return {
            "device": str(self.device),
            "compute_dtype": _dtype_name(self.dtype),
            "weight_dtype": _dtype_name(self.weight_dtype or self.dtype),
            "kv_cache_dtype": _dtype_name(self.kv_cache_dtype),
            "cpu_kernels": build.isa() if self.kernels else f"off: {self.kernels_off_reason}",
            "attention": self.attention.name,
            **self.attention.choices(),
            "layer_ops": self.ops.name,
            "sampler_draw": "cpu_kernel" if self.draw is not None else "torch",
            "sampler_argmax": "cpu_kernel" if self.argmax is not None else "torch",
            "fused_decode_layer": self.fused_decode_layer,
            "weights": self.weights_report,
            "huge_pages": self.huge_pages and memory.huge_pages_supported(self.device),
        }


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    config: BackendConfig,
    weight_dtype: torch.dtype | None = None,
) -> ModelBackend:
    """The backend for this device and these dtypes under `config` (see the module's table).
    Loads (and on first use builds) the CPU kernels when it picks them. Raises ValueError for
    an attention_backend that is unknown or cannot run here."""
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got "
            f"{config.attention_backend!r}."
        )
    kernels, off_reason = False, ""
    if device.type != "cpu":
        off_reason = f"device {device.type}"
    elif not config.cpu_kernels:
        off_reason = "cpu_kernels=False"
    elif not build.load():
        off_reason = "the build failed (see the warning above)"
    else:
        kernels = True
    paged_ok = kernels and kv_cache_dtype in (torch.float32, torch.bfloat16)
    attention = _attention(config.attention_backend, paged_ok, dtype, kv_cache_dtype)
    ops: LayerOps = TorchOps()
    if kernels and dtype == torch.float32:
        from octavo.model.backends.cpu import CpuKernelOps

        ops = CpuKernelOps()
    draw = argmax = None
    if kernels and build.vectorized():
        from octavo.model.cpu.ops import argmax_rows, sample_categorical

        draw, argmax = sample_categorical, argmax_rows
    return ModelBackend(
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        attention=attention,
        ops=ops,
        draw=draw,
        kernels=kernels,
        huge_pages=config.huge_pages,
        calibration=MatmulCalibration(config.packed_max_rows) if kernels else None,
        bf16_dequantized_gemm=(
            config.bf16_dequantized_gemm and dtype == torch.float32 and device.type == "cpu"
        ),
        kernels_off_reason=off_reason,
        argmax=argmax,
        weight_dtype=None if weight_dtype == dtype else weight_dtype,
    )


def _attention(
    name: str, paged_ok: bool, dtype: torch.dtype, kv_cache_dtype: torch.dtype
) -> AttentionBackend:
    if name == "reference":
        return ReferenceAttention()
    if name == "sdpa" or (name == "auto" and not paged_ok):
        return SdpaAttention()
    if not paged_ok:
        raise ValueError(
            "attention_backend='cpu_paged' needs the CPU kernels and a float32 or bfloat16 KV "
            f"cache (kv_cache_dtype={_dtype_name(kv_cache_dtype)})."
        )
    from octavo.model.backends.cpu import CpuPagedAttention

    # Prompt chunks over a bfloat16 cache take bfloat16 products where the CPU has them: AMX
    # tiles (1.6x the float32 kernel's speed on a 256-token prompt, 2x on eight 256-token
    # chunks after 256 cached tokens each, 2.3x on a 1024-token prompt; an Intel Xeon with
    # AMX), else AVX512-BF16 dot products (1.5x, 1.4x, 1.6x on a Zen 4), the queries and
    # softmax weights rounded to bfloat16 as a bf16 model's own attention rounds them
    # (tests/model/test_cpu_kernels.py). Decodes the same way, by AVX512-BF16 dot products:
    # 0.86-0.92x the float kernel's time on 1, 8 and 32 sequences of 320 tokens (30 layers;
    # `python -m octavo.model.cpu --bench --attention`, a Zen 4), 0.68x with the cache in L3.
    tiles = kv_cache_dtype == torch.bfloat16 and cpu_ops.bf16_tiles_available()
    return CpuPagedAttention(dtype, prefill_tiles=tiles, decode_bf16=tiles)


def weight_bytes_by_type(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights as they are held, by type (GGML block types by name,
    float tensors by dtype), largest first: what the start-up line states. Packed copies
    are not counted here (the report's packed_bytes)."""
    sizes: dict[str, int] = {}

    def add(kind: str, nbytes: int) -> None:
        sizes[kind] = sizes.get(kind, 0) + nbytes

    for module in model.modules():
        fmt = getattr(module, "weight_format", None) or getattr(module, "head_format", None)
        for part in getattr(fmt, "parts", [fmt]):
            if isinstance(part, QuantizedWeight):
                add(part.name, part.nbytes)
        for param in module.parameters(recurse=False):
            if param.device.type != "meta":
                add(_dtype_name(param.dtype), param.numel() * param.element_size())
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def _same_kind(a: QuantizedTensor | Tensor, b: QuantizedTensor | Tensor) -> bool:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return a.qtype == b.qtype
    return not isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
