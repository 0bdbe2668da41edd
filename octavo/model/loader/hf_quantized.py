"""Hugging Face checkpoints quantized by GPTQ, AWQ or compressed-tensors, read into the GGML
block types octavo computes on, where their layout maps onto one exactly.

Each format stores a linear layer's weight as small integers with one float scale (and, for
asymmetric ones, one integer zero point) per group of `group_size` weights along the input,
packed eight 4-bit or four 8-bit values to an int32:

- GPTQ (quant_method "gptq"): `qweight` (k / pack, n) packed along the input, `qzeros`
  (groups, n / pack) packed along the output, `scales` (groups, n) float16, `g_idx` (k) each
  input's group. w = scale * (q - zero), where the "gptq" checkpoint format stores zero - 1
  (what its kernels add back) and "gptq_v2" stores zero itself.
- AWQ (quant_method "awq", version "gemm"): `qweight` (k, n / 8) and `qzeros` (groups, n / 8)
  packed along the output in AWQ's interleaved order, `scales` (groups, n).
  w = scale * (q - zero).
- compressed-tensors (quant_method "compressed-tensors"): format "pack-quantized":
  `weight_packed` (n, k / 8) packed along the input with 8 added to each signed value,
  `weight_scale` (n, groups), `weight_shape`; format "int-quantized" / "naive-quantized":
  `weight` int8 (n, k) and `weight_scale` (n, groups). Symmetric: w = scale * q.

A group of 32 or a multiple is a whole number of GGML's 32-weight blocks, so each block takes
its group's scale: symmetric 4-bit weights (every zero 8) are Q4_0 (w = d * (q - 8)),
asymmetric ones Q4_1 (w = d * q + m, with m = -scale * zero rounded to float16, the one value
not carried exactly), symmetric 8-bit ones Q8_0 (w = d * q). Scales become float16: exact for
float16 and for bfloat16 scales in float16's normal range, rounded for float32 ones.

What does not map is refused naming the format and the setting: other bit widths, AWQ's other
layouts, activation-order (`desc_act`) groups that are not runs of 32 inputs, asymmetric 8-bit
weights, compressed-tensors' float and block strategies. Knows nothing of models: it turns
(name, tensor) pairs into (name, tensor or QuantizedTensor) pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from octavo.model.formats.ggml import GGMLType, QuantizedTensor
from octavo.model.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "IntScheme", "read_scheme", "repack"]

# quant_method values of config.json's quantization_config read here (also --quantization's
# names for "the checkpoint's own method").
METHODS = ("gptq", "awq", "compressed-tensors")
_BLOCK = 32

# The tensors of one linear layer in each method's files: the ones it needs, the ones it may
# have. Everything else (biases, norms, unquantized layers) passes through.
_PARTS = {
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "pack-quantized": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_g_idx"}),
    "int-quantized": ({"weight", "weight_scale"}, {"input_scale", "input_zero_point"}),
}
# AWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into an int32's nibbles 0-7; nibble j holds
# column _AWQ_COLUMN[j] of its eight.
_AWQ_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class IntScheme:
    """One checkpoint's integer weight format, as read from its quantization_config."""

    method: str  # a METHODS member
    layout: str  # a _PARTS key: "gptq", "awq", "pack-quantized" or "int-quantized"
    bits: int  # 4 or 8
    group_size: int  # inputs per scale; 0: one scale per output channel
    symmetric: bool
    zero_offset: int = 0  # added to stored zero points (GPTQ's "gptq" format: 1)

    @property
    def block_types(self) -> tuple[str, ...]:
        """The GGML block types its matrices become (ModelConfig.weight_block_types)."""
        if self.bits == 8:
            return ("Q8_0",)
        return ("Q4_0",) if self.symmetric else ("Q4_0", "Q4_1")

    @property
    def parts(self) -> tuple[set[str], set[str]]:
        return _PARTS[self.layout]


def read_scheme(config: Any, where: str) -> IntScheme:
    """config.json's quantization_config -> its IntScheme. Raises ModelLoadError naming the
    method and the setting octavo cannot map onto its block types."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object; got {config!r}.")
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelLoadError(
            f"{where}: a checkpoint quantized with {method or 'an unnamed method'!r} "
            f"(config.json quantization_config), which octavo does not load. It loads "
            f"{', '.join(METHODS)} checkpoints of 4- and 8-bit integer weights, GGUF files, and "
            "float checkpoints with --quantization (q8_0, q4_0, ...)."
        )
    scheme = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}[method](
        config, where
    )
    if scheme.group_size % _BLOCK:
        raise ModelLoadError(
            f"{where}: {method} group_size {scheme.group_size} is not a multiple of 32, the "
            "weights of a GGML block, so its scales do not map onto blocks."
        )
    return scheme


def _refuse(where: str, method: str, setting: str) -> ModelLoadError:
    return ModelLoadError(
        f"{where}: {method} checkpoint with {setting}, which octavo does not load (it maps "
        "4-bit and symmetric 8-bit integer weights with groups of 32 inputs or a multiple onto "
        "its block types)."
    )


def _group_size(value: Any) -> int:
    return 0 if value in (None, -1, 0) else int(value)


def _gptq(config: dict[str, Any], where: str) -> IntScheme:
    bits = int(config.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse(where, "gptq", f"bits={bits}")
    checkpoint_format = str(config.get("checkpoint_format", "gptq"))
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _refuse(where, "gptq", f"checkpoint_format={checkpoint_format!r}")
    symmetric = bool(config.get("sym", True))
    if bits == 8 and not symmetric:
        raise _refuse(where, "gptq", "asymmetric 8-bit weights (sym=false)")
    return IntScheme(
        "gptq",
        "gptq",
        bits,
        _group_size(config.get("group_size", 128)),
        symmetric,
        # desc_act needs nothing here: g_idx says each input's group either way.
        zero_offset=1 if checkpoint_format == "gptq" else 0,
    )


def _awq(config: dict[str, Any], where: str) -> IntScheme:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    if bits != 4:
        raise _refuse(where, "awq", f"bits={bits}")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(where, "awq", f"version={version!r} (its layout differs from GEMM's)")
    group = _group_size(config.get("group_size", config.get("q_group_size", 128)))
    return IntScheme("awq", "awq", 4, group, not bool(config.get("zero_point", True)))


def _compressed_tensors(config: dict[str, Any], where: str) -> IntScheme:
    layout = str(config.get("format", ""))
    if layout == "naive-quantized":
        layout = "int-quantized"  # the same tensors
    if layout not in ("pack-quantized", "int-quantized"):
        raise _refuse(where, "compressed-tensors", f"format={layout!r}")
    groups = config.get("config_groups") or {}
    schemes = [group.get("weights") or {} for group in groups.values()]
    if len({repr(sorted(s.items())) for s in schemes}) != 1:
        raise _refuse(where, "compressed-tensors", f"{len(schemes)} different weight schemes")
    weights = schemes[0]
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    strategy = weights.get("strategy", "tensor")
    if kind != "int" or bits not in (4, 8):
        raise _refuse(where, "compressed-tensors", f"{bits}-bit {kind} weights")
    if strategy not in ("channel", "group", "tensor"):
        raise _refuse(where, "compressed-tensors", f"strategy={strategy!r}")
    if not weights.get("symmetric", True):
        raise _refuse(where, "compressed-tensors", "asymmetric weights (symmetric=false)")
    if (layout == "pack-quantized") != (bits == 4):
        raise _refuse(where, "compressed-tensors", f"{bits}-bit weights in format {layout!r}")
    if weights.get("actorder") not in (None, "static", False):
        raise _refuse(where, "compressed-tensors", f"actorder={weights['actorder']!r}")
    group = _group_size(weights.get("group_size")) if strategy == "group" else 0
    if any(scheme.get("input_activations") for scheme in groups.values()):
        logger.info(
            "compressed-tensors: the checkpoint's input_activations scheme is not applied; "
            "activations are computed as octavo's block kernels compute them (float, or "
            "rounded to 8 bits per row where the kernel does)"
        )
    return IntScheme("compressed-tensors", layout, bits, group, True)


def repack(
    tensors: Iterable[tuple[str, Tensor]], scheme: IntScheme
) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with each quantized linear layer's parts replaced by its
    `PREFIX.weight` as a QuantizedTensor, yielded once all its parts have been read (a layer's
    parts may be spread over a shard's keys). Raises ModelLoadError for a layer whose parts
    are missing or do not agree in shape."""
    needed, optional = scheme.parts
    pending: dict[str, dict[str, Tensor]] = {}
    done: dict[str, int] = {}  # converted layers' inputs
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        is_part = part in needed or part in optional
        if scheme.layout == "int-quantized" and part == "weight":
            is_part = tensor.dtype == torch.int8  # float layers keep float weights
        if not is_part:
            yield name, tensor
            continue
        if prefix in done:  # an order index read after its layer: only the plain one maps
            if part in _ORDER_PARTS:
                _block_groups(prefix, tensor, scheme, done[prefix], after=True)
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if needed <= parts.keys():
            del pending[prefix]
            weight = _convert(prefix, parts, scheme)
            done[prefix] = weight.shape[1]
            yield f"{prefix}.weight", weight
    for prefix, parts in pending.items():
        if parts.keys() <= optional:
            continue  # e.g. a static input scale of a layer left float
        missing = ", ".join(sorted(needed - parts.keys()))
        raise ModelLoadError(f"{scheme.method}: {prefix} lacks {missing}.")


_ORDER_PARTS = ("g_idx", "weight_g_idx")


def _convert(prefix: str, parts: dict[str, Tensor], scheme: IntScheme) -> QuantizedTensor:
    """One layer's parts -> its blocks. Scales and zeros come as (n, groups), or (1, 1) for
    one value over the whole matrix."""
    try:
        if scheme.layout == "gptq":
            q, scale, zero = _gptq_parts(parts, scheme)
        elif scheme.layout == "awq":
            q, scale, zero = _awq_parts(parts, scheme)
        elif scheme.layout == "pack-quantized":
            q, scale, zero = _packed_parts(parts)
        else:
            weight = parts["weight"]
            q, scale = weight.to(torch.int16) + 128, parts["weight_scale"]
            zero = torch.full((1, 1), 128, dtype=torch.int16)
        n, k = q.shape
        if k % _BLOCK:
            raise ValueError(f"{k} inputs are not a whole number of 32-weight blocks")
        order = next((parts[p] for p in _ORDER_PARTS if p in parts), None)
        groups = _block_groups(prefix, order, scheme, k)
        return _blocks(q, _per_block(scale, n, groups), _per_block(zero, n, groups), scheme.bits)
    except ModelLoadError:
        raise  # it names the layer already
    except (RuntimeError, ValueError, IndexError) as exc:
        raise ModelLoadError(f"{scheme.method}: {prefix}: {exc}.") from None


def _block_groups(
    prefix: str, order: Tensor | None, scheme: IntScheme, k: int, after: bool = False
) -> Tensor:
    """The scale group of each 32-weight block of a row: by position (group_size), or by
    the checkpoint's order index (GPTQ's g_idx, each input's group) where each block's 32
    inputs share one; refused where they do not (activation order over single inputs)."""
    by_position = torch.arange(0, k, _BLOCK) // (scheme.group_size or k)
    if order is None:
        return by_position
    groups = order.to(torch.int64).reshape(-1)
    if groups.numel() != k:
        raise ModelLoadError(f"{scheme.method}: {prefix}: {groups.numel()} g_idx for {k} inputs.")
    by_block = groups.reshape(-1, _BLOCK)
    if after and not torch.equal(by_block[:, 0], by_position):
        raise ModelLoadError(
            f"{scheme.method}: {prefix}: its g_idx, read after its weights, reorders the groups."
        )
    if not bool((by_block == by_block[:, :1]).all()):
        raise _refuse(
            prefix, scheme.method, "activation order (desc_act) over single inputs (g_idx)"
        )
    return by_block[:, 0]


def _unpack(packed: Tensor, bits: int, dim: int) -> Tensor:
    """int32 values packed 32 / bits to a word (value j at bits j * bits) along `dim` ->
    their unsigned values (int16), that dimension 32 / bits times longer."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)
    values = ((words >> shifts) & ((1 << bits) - 1)).to(torch.int16)  # (..., per_word)
    if dim == 1:
        return values.reshape(packed.shape[0], packed.shape[1] * per_word)
    return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])


def _gptq_parts(parts: dict[str, Tensor], scheme: IntScheme) -> tuple[Tensor, Tensor, Tensor]:
    q = _unpack(parts["qweight"], scheme.bits, 0).t()  # (n, k)
    zero = _unpack(parts["qzeros"], scheme.bits, 1) + scheme.zero_offset  # (groups, n)
    scale = parts["scales"]  # (groups, n)
    n = q.shape[0]
    return q, scale.t(), zero[:, :n].t()


def _awq_parts(parts: dict[str, Tensor], scheme: IntScheme) -> tuple[Tensor, Tensor, Tensor]:
    def columns(packed: Tensor) -> Tensor:
        values = _unpack(packed, 4, 1).reshape(packed.shape[0], -1, 8)
        ordered = torch.empty_like(values)
        ordered[:, :, list(_AWQ_COLUMN)] = values
        return ordered.reshape(packed.shape[0], -1)

    q = columns(parts["qweight"]).t()  # (n, k)
    zero = columns(parts["qzeros"]).t()  # (n, groups)
    if scheme.symmetric:
        zero = torch.full_like(zero, 8)
    return q, parts["scales"].t(), zero


def _packed_parts(parts: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    n, k = (int(v) for v in parts["weight_shape"].reshape(-1)[:2])
    q = _unpack(parts["weight_packed"], 4, 1)[:, :k]  # stored as q + 8
    if q.shape[0] != n:
        raise ValueError(f"weight_packed has {q.shape[0]} rows for weight_shape {n} x {k}")
    return q, parts["weight_scale"], torch.full((1, 1), 8, dtype=torch.int16)


def _per_block(values: Tensor, n: int, groups: Tensor) -> Tensor:
    """Per-row group values (n, groups), or one value (1, 1), -> one per block (n, blocks)."""
    values = values.reshape(values.shape[0], -1) if values.dim() else values.reshape(1, 1)
    if values.shape[1] == 1:
        return values.expand(n, groups.numel())
    if values.shape[0] not in (1, n):
        raise ValueError(f"{values.shape[0]} rows of scales or zeros for {n} outputs")
    return values[:, groups].expand(n, groups.numel())


def _blocks(q: Tensor, scale: Tensor, zero: Tensor, bits: int) -> QuantizedTensor:
    """Unsigned q (n, k) with per-block float scales and integer zeros (n, k / 32) as Q4_0,
    Q4_1 or Q8_0 blocks: w = scale * (q - zero)."""
    n, k = q.shape

    def f16_field(values: Tensor) -> Tensor:  # (n, blocks) -> their float16 bytes per block
        return values.to(torch.float16).contiguous().view(torch.uint8).reshape(n, -1, 2)

    if bits == 8:
        if not bool((zero == 128).all()):
            raise ValueError("8-bit weights with zero points other than 128 (asymmetric)")
        qs = (q - 128).to(torch.int8).reshape(n, -1, _BLOCK).view(torch.uint8)
        qtype, fields = GGMLType.Q8_0, [f16_field(scale), qs]
    else:
        nibbles = q.to(torch.uint8).reshape(n, -1, _BLOCK)
        qs = nibbles[..., :16] | (nibbles[..., 16:] << 4)
        if bool((zero == 8).all()):
            qtype, fields = GGMLType.Q4_0, [f16_field(scale), qs]  # w = d * (q - 8)
        else:
            m = -(scale.float() * zero.float())  # w = d * q + m
            qtype, fields = GGMLType.Q4_1, [f16_field(scale), f16_field(m), qs]
    blocks = torch.cat(fields, dim=-1).reshape(n, -1).contiguous()
    return QuantizedTensor(blocks, qtype, (n, k))
