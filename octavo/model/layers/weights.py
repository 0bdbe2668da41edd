"""Copying checkpoint tensors (Hugging Face names) into a model's parameters.

A model declares which checkpoint projections it packs (`packed_modules_mapping`, e.g.
"q_proj" -> ("qkv_proj", "q")); this module derives from it the full list of checkpoint names the
model expects, copies each tensor into place and checks that every one arrived exactly once.
It must not read files: tensors come in as (name, tensor) pairs from any loader. A tensor in
GGML blocks (formats.ggml.QuantizedTensor) is kept as blocks where a linear layer's or an
embedding's weight takes it, and dequantized where anything else does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.layers.embedding import VocabEmbedding
from octavo.model.layers.linear import Linear, PackedLinear

# Names some checkpoints carry that no octavo model needs (old HF Llama saved RoPE buffers).
_ALWAYS_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

PackedMapping = Mapping[str, tuple[str, str]]


def expected_checkpoint_names(
    model: nn.Module, packed_modules_mapping: PackedMapping
) -> dict[str, Callable[[Tensor | QuantizedTensor], None]]:
    """checkpoint name -> function that copies a tensor of that name into the model."""
    unpacked = {(packed, shard): name for name, (packed, shard) in packed_modules_mapping.items()}
    loaders: dict[str, Callable[[Tensor | QuantizedTensor], None]] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, PackedLinear):
                parent, _, packed = module_name.rpartition(".")
                for shard in module.shard_sizes:
                    name = f"{parent}.{unpacked[(packed, shard)]}.{param_name}"
                    loaders[name] = _shard_loader(module, shard, param_name)
            else:
                loaders[prefix + param_name] = _param_loader(module, param_name, param)
    return loaders


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Tensor | QuantizedTensor]],
    packed_modules_mapping: PackedMapping,
    ignored_names: frozenset[str] = frozenset(),
) -> None:
    """Copy every (name, tensor) into `model`. Raises ValueError naming the tensor for a name
    the model has no place for, a shape mismatch, or a duplicate; and listing what is missing
    once the iterable is exhausted. `ignored_names` are accepted and dropped (e.g. lm_head.weight
    of a checkpoint whose embeddings are tied)."""
    loaders = expected_checkpoint_names(model, packed_modules_mapping)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in ignored_names or name.endswith(_ALWAYS_IGNORED_SUFFIXES):
            continue
        if name in loaded:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint.")
        loader = loaders.get(name)
        if loader is None:
            raise ValueError(
                f"checkpoint tensor {name!r} has no counterpart in {type(model).__name__}."
            )
        try:
            loader(tensor)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        loaded.add(name)
    missing = sorted(set(loaders) - loaded)
    if missing:
        shown = ", ".join(missing[:5])
        if len(missing) > 5:
            shown += f", ... ({len(missing)} in all)"
        raise ValueError(f"checkpoint is missing tensors: {shown}.")


def _param_loader(
    module: nn.Module, param_name: str, param: nn.Parameter
) -> Callable[[Tensor | QuantizedTensor], None]:
    keeps_blocks = param_name == "weight" and isinstance(module, (Linear, VocabEmbedding))

    def load(tensor: Tensor | QuantizedTensor) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}.")
        if isinstance(tensor, QuantizedTensor):
            if keeps_blocks:
                module.quantized = tensor
                return
            tensor = tensor.dequantize(param.dtype)
        with torch.no_grad():
            param.data.copy_(tensor)

    return load


def _shard_loader(
    module: PackedLinear, shard: str, param_name: str
) -> Callable[[Tensor | QuantizedTensor], None]:
    return lambda tensor: module.load_shard(shard, param_name, tensor)
