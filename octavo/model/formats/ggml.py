"""GGML's block types: their sizes, and dequantization in plain torch (the reference).

A quantized GGUF tensor of shape (n, k) is n rows of k / block_size blocks; a row's blocks are
contiguous, so rows can be gathered, permuted and concatenated as bytes. Each block holds
block_size weights as small integers with one or a few float16 scales (K-quants: 256 weights
in sub-blocks of 16 or 32, each with its own 4-, 6- or 8-bit scale). `dequantize` is written
from the layouts of llama.cpp's ggml-common.h and checked against the `gguf` package's numpy
dequantization (tests/model/test_quantized.py); it runs on any device, and is what every
kernel over these blocks is tested against. Knows nothing of models or files.

Types and ids are GGML's own (gguf.GGMLQuantizationType), so a tensor's type can be handed to
the kernels as the integer the file stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as GGMLType
from torch import Tensor

__all__ = [
    "BLOCK_TYPES",
    "K_FALLBACK",
    "MIXES",
    "QUANTIZABLE_TYPES",
    "BlockType",
    "GGMLType",
    "QuantizedTensor",
    "dequantize",
    "mix_type",
    "quantize",
    "quantized_type",
    "row_bytes",
]


@dataclass(frozen=True)
class BlockType:
    """One GGML block type: weights per block, bytes per block, and where in a block its
    float16 scales lie (every other byte is integer data: any bit pattern there is valid)."""

    ggml: GGMLType
    block_size: int
    type_size: int
    f16_offsets: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.ggml.name

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size


# The block types octavo computes on (float types F32/F16/BF16 are loaded as float tensors).
BLOCK_TYPES: dict[GGMLType, BlockType] = {
    t: BlockType(t, size, nbytes, offsets)
    for t, size, nbytes, offsets in (
        (GGMLType.Q4_0, 32, 18, (0,)),
        (GGMLType.Q4_1, 32, 20, (0, 2)),
        (GGMLType.Q5_0, 32, 22, (0,)),
        (GGMLType.Q5_1, 32, 24, (0, 2)),
        (GGMLType.Q8_0, 32, 34, (0,)),
        (GGMLType.Q2_K, 256, 84, (80, 82)),
        (GGMLType.Q3_K, 256, 110, (108,)),
        (GGMLType.Q4_K, 256, 144, (0, 2)),
        (GGMLType.Q5_K, 256, 176, (0, 2)),
        (GGMLType.Q6_K, 256, 210, (208,)),
    )
}


def row_bytes(qtype: GGMLType, k: int) -> int:
    """Bytes of one row of k weights. Raises ValueError if k is not a whole number of blocks."""
    block = BLOCK_TYPES[qtype]
    if k % block.block_size:
        raise ValueError(f"{qtype.name} rows hold whole blocks of {block.block_size}; got {k}.")
    return k // block.block_size * block.type_size


@dataclass
class QuantizedTensor:
    """A 2-D checkpoint tensor kept as GGML blocks: `shape` (n, k) weights held in `blocks`,
    (n, row_bytes(qtype, k)) uint8, row i's blocks being weight row i. What a loader hands a
    model in place of a float tensor for a block type."""

    blocks: Tensor
    qtype: GGMLType
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        expected = (n, row_bytes(self.qtype, k))
        if tuple(self.blocks.shape) != expected or self.blocks.dtype != torch.uint8:
            raise ValueError(
                f"{self.qtype.name} blocks of a {n} x {k} tensor must be uint8 {expected}; got "
                f"{self.blocks.dtype} {tuple(self.blocks.shape)}."
            )

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.blocks, self.qtype, self.shape[1], dtype)


# The block types a float weight can be quantized to here: the 32-weight ones by gguf's numpy
# quantizers (llama.cpp's reference rounding), the K-quants by formats/kquants.py.
QUANTIZABLE_TYPES = (
    GGMLType.Q8_0,
    GGMLType.Q6_K,
    GGMLType.Q5_K,
    GGMLType.Q5_1,
    GGMLType.Q5_0,
    GGMLType.Q4_K,
    GGMLType.Q4_1,
    GGMLType.Q4_0,
)
# What a matrix whose rows are not whole 256-blocks gets instead of a K-quant (as llama.cpp's
# llama-quantize does).
K_FALLBACK = {
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}


def quantize(weight: Tensor, qtype: GGMLType) -> QuantizedTensor:
    """A float (n, k) CPU tensor as `qtype` blocks (a QUANTIZABLE_TYPES member). Raises
    ValueError for another type or a k that is not a whole number of blocks."""
    from gguf.quants import quantize as gguf_quantize

    from octavo.model.formats import kquants

    if qtype not in QUANTIZABLE_TYPES:
        names = ", ".join(t.name for t in QUANTIZABLE_TYPES)
        raise ValueError(f"cannot quantize to {qtype.name} (quantizable: {names}).")
    n, k = weight.shape
    row_bytes(qtype, k)  # raises for a ragged row
    k_quant = {
        GGMLType.Q4_K: kquants.quantize_q4_k,
        GGMLType.Q5_K: kquants.quantize_q5_k,
        GGMLType.Q6_K: kquants.quantize_q6_k,
    }.get(qtype)
    if k_quant is not None:
        return QuantizedTensor(k_quant(weight), qtype, (n, k))
    blocks = gguf_quantize(weight.detach().float().numpy(), qtype)
    return QuantizedTensor(torch.from_numpy(blocks).reshape(n, -1), qtype, (n, k))


def quantized_type(qtype: GGMLType, k: int) -> GGMLType | None:
    """The type a matrix of rows of k weights is quantized to when `qtype` is asked: qtype if
    its rows are whole blocks, a K-quant's fallback (K_FALLBACK) if those are, else None (the
    matrix stays float)."""
    for candidate in (qtype, K_FALLBACK.get(qtype)):
        if candidate is not None and k % BLOCK_TYPES[candidate].block_size == 0:
            return candidate
    return None


# Mixes of types by tensor role, named as llama.cpp's llama-quantize names them: (the base
# type, the type of the layers' attn_v and ffn_down where more bits are given).
MIXES = {"q4_k_m": (GGMLType.Q4_K, GGMLType.Q6_K), "q5_k_m": (GGMLType.Q5_K, GGMLType.Q6_K)}


def mix_type(mix: str, role: str, layer: int | None, num_layers: int, tied: bool) -> GGMLType:
    """The type `mix` (a MIXES key) gives a matrix of `role` (attn_q ... ffn_down in GGUF's
    naming, token_embd, output) in `layer`: Q6_K for the output projection (a tied embedding
    is it), more bits for attn_v and ffn_down in the first and last eighth of the layers and
    every third between (llama.cpp's rule), the base type elsewhere."""
    base, more = MIXES[mix]
    if role == "output" or (role == "token_embd" and tied):
        return GGMLType.Q6_K
    if role in ("attn_v", "ffn_down") and layer is not None:
        eighth = num_layers // 8
        if layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2:
            return more
    return base


def dequantize(
    blocks: Tensor, qtype: GGMLType, k: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """blocks: (rows, row_bytes(qtype, k)) uint8, any device -> (rows, k) weights in `dtype`
    (computed in float32)."""
    block = BLOCK_TYPES[qtype]
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, block.type_size)
    values = _DEQUANTIZE[qtype](flat)
    return values.reshape(rows, k).to(dtype)


# ------------------------------------------------------------------ the layouts


def _f16(b: Tensor, offset: int) -> Tensor:
    """The float16 at byte `offset` of every block, as (num_blocks, 1) float32."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """(nb, 16) bytes -> (nb, 32): the low nibbles (weights 0-15), then the high (16-31)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _bits32(qh: Tensor) -> Tensor:
    """(nb, 4) bytes of a little-endian 32-bit mask -> (nb, 32) bits, bit j at column j."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: Tensor) -> Tensor:
    # d (f16), qs[16]: w = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b: Tensor) -> Tensor:
    # d, m (f16), qs[16]: w = d * q + m
    return _f16(b, 0) * _nibbles(b[:, 4:20]).float() + _f16(b, 2)


def _q5_0(b: Tensor) -> Tensor:
    # d (f16), qh (32 high bits), qs[16]: w = d * (q - 16)
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: Tensor) -> Tensor:
    # d, m (f16), qh, qs[16]: w = d * q + m
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    # d (f16), qs[32] int8: w = d * q
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _per_sub_block(values: Tensor, scales: Tensor) -> Tensor:
    """(nb, 256) values times (nb, s) per-sub-block factors, each over 256 / s weights."""
    nb, count = scales.shape
    return (values.view(nb, count, -1) * scales.unsqueeze(-1)).reshape(nb, 256)


def _two_bit_planes(qs: Tensor) -> Tensor:
    """(nb, 64) bytes -> (nb, 256): weight 128h + 32j + l is bits 2j..2j+1 of byte 32h + l."""
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.uint8).view(1, 1, 4, 1)
    return ((qs.view(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _q2_k(b: Tensor) -> Tensor:
    # scales[16] (low nibble scale, high nibble min, per 16 weights), qs[64], d, dmin:
    # w = d * scale * q - dmin * min
    scales = b[:, 0:16]
    q = _two_bit_planes(b[:, 16:80]).float()
    d, dmin = _f16(b, 80), _f16(b, 82)
    return _per_sub_block(q, d * (scales & 0xF).float()) - _per_sub_block(
        torch.ones_like(q), dmin * (scales >> 4).float()
    )


def _q3_k_scales(s: Tensor) -> Tensor:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0-7 (low nibbles for scales
    0-7, high nibbles for 8-15), high 2 bits of scale i from byte 8 + i % 4 at bit 2 * (i // 4)."""
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=1)
    i = torch.arange(16, device=s.device)
    high = (s[:, 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    return (low | (high << 4)).float() - 32


def _q3_k(b: Tensor) -> Tensor:
    # hmask[32], qs[64], scales[12], d: w = d * scale * (q2 - (high bit ? 0 : 4)); the high
    # bit of weight 128h + 32j + l is bit 4h + j of hmask[l].
    low = _two_bit_planes(b[:, 32:96])
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    high = ((b[:, 0:32].unsqueeze(1) >> shifts) & 1).reshape(-1, 256)
    q = low.float() - 4 * (1 - high.float())
    return _per_sub_block(q, _f16(b, 108) * _q3_k_scales(b[:, 96:108]))


def _k4_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins (ggml's get_scale_min_k4):
    j < 4: scale = s[j] & 63, min = s[j + 4] & 63; else scale = s[j + 4] & 15 | (s[j - 4] >> 6)
    << 4, min = s[j + 4] >> 4 | (s[j] >> 6) << 4."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k4_nibbles(qs: Tensor) -> Tensor:
    """(nb, 128) bytes -> (nb, 256): 64 weights per 32 bytes, the low nibbles then the high."""
    qs = qs.view(-1, 4, 32)
    return torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 256)


def _q4_k(b: Tensor) -> Tensor:
    # d, dmin, scales[12], qs[128]: w = d * scale * q - dmin * min, per 32 weights
    scales, mins = _k4_scales(b[:, 4:16])
    q = _k4_nibbles(b[:, 16:144]).float()
    return _per_sub_block(q, _f16(b, 0) * scales) - _per_sub_block(
        torch.ones_like(q), _f16(b, 2) * mins
    )


def _q5_k(b: Tensor) -> Tensor:
    # d, dmin, scales[12], qh[32], qs[128]: as Q4_K with a fifth bit: weight 64j + 32h + l
    # takes bit 2j + h of qh[l]
    scales, mins = _k4_scales(b[:, 4:16])
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    high = ((b[:, 16:48].unsqueeze(1) >> shifts) & 1).reshape(-1, 256)
    q = (_k4_nibbles(b[:, 48:176]) | (high << 4)).float()
    return _per_sub_block(q, _f16(b, 0) * scales) - _per_sub_block(
        torch.ones_like(q), _f16(b, 2) * mins
    )


def _q6_k(b: Tensor) -> Tensor:
    # ql[128], qh[64], scales[16] int8, d: w = d * scale * (q - 32), per 16 weights. In each
    # half h of 128 weights, weight 32i + l (i < 4) has its low 4 bits in ql[64h + 32(i % 2)
    # + l] (low nibble for i < 2, high for i >= 2) and its high 2 bits at bit 2i of qh[32h + l].
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # (nb, half, i % 2, l)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # (nb, half, i, l)
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).reshape(-1, 256).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return _per_sub_block(q, _f16(b, 208) * scales)


_DEQUANTIZE = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
