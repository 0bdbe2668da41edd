"""Model loading: a checkpoint path -> a model with its weights on a device, plus its config.

Owns deciding what a path holds (a Hugging Face folder with safetensors, or a GGUF file), building
the model without initialising weights it is about to overwrite, and turning every failure into
one ModelLoadError with a message that names the path and the problem. File formats live in
`safetensors.py` and `gguf.py`; model code never reads files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from octavo.model.config import ModelConfig
from octavo.model.layers.linear import attach_packed_weights
from octavo.model.loader.errors import ModelLoadError
from octavo.model.loader.gguf import (
    find_default_model,
    open_gguf_checkpoint,
    read_gguf_chat_template,
)
from octavo.model.loader.safetensors import open_hf_checkpoint
from octavo.model.registry import get_model_class

logger = logging.getLogger(__name__)

__all__ = [
    "ModelLoadError",
    "build_model",
    "find_default_model",
    "load_model",
    "read_gguf_chat_template",
]


def load_model(
    path: str, dtype: torch.dtype, device: torch.device | str
) -> tuple[nn.Module, ModelConfig]:
    """Load a Hugging Face folder (config.json and *.safetensors, sharded ones through
    model.safetensors.index.json) or a .gguf file (or a folder holding exactly one .gguf).

    Returns the model in eval mode with every parameter in `dtype` on `device`, and its config.
    Raises ModelLoadError for a missing path, an unsupported architecture, RoPE type or GGUF
    tensor type, a truncated or corrupt file, and missing or unexpected tensors.
    """
    source = Path(path)
    if not source.exists():
        raise ModelLoadError(f"Model path {path!r} does not exist.")
    start_s = time.perf_counter()
    config, weights = _open_checkpoint(source)
    try:
        model = build_model(config, dtype, device)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    try:
        model.load_weights(weights)
    except ModelLoadError:
        raise
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    num_packed, num_bf16, packed_bytes = attach_packed_weights(model)
    if num_packed:
        logger.info(
            "packed %d weights for decode-sized matmuls (%.0f MiB more; %d of them in "
            "bfloat16, which holds their values exactly)",
            num_packed,
            packed_bytes / 2**20,
            num_bf16,
        )
    num_params = sum(param.numel() for param in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM parameters, %s on %s) in %.1f s",
        path,
        config.architecture,
        num_params / 1e6,
        dtype,
        device,
        time.perf_counter() - start_s,
    )
    return model.eval(), config


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model class for config.architecture with parameters allocated (not initialised) in
    `dtype` on `device`, requires_grad off (inference only); the caller must load every weight.
    Raises ModelLoadError for an unsupported architecture."""
    try:
        model_class = get_model_class(config.architecture)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    # Built on the meta device: random initialisation of weights that are overwritten anyway
    # costs seconds for a large model, and a float32 copy before the cast would double memory.
    with torch.device("meta"):
        model = model_class(config)
    # Parameters are replaced by hand rather than with Module.to_empty, whose meta-tensor
    # dispatch imports torch's symbolic-shape machinery (over a second of start-up).
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))
    return model


def _open_checkpoint(source: Path) -> tuple[ModelConfig, Iterable[tuple[str, Tensor]]]:
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelLoadError(f"{source}: expected a .gguf file or a Hugging Face model folder.")
        return open_gguf_checkpoint(source)
    if (source / "config.json").is_file():
        return open_hf_checkpoint(source)
    ggufs = sorted(source.glob("*.gguf"))
    if len(ggufs) == 1:
        return open_gguf_checkpoint(ggufs[0])
    raise ModelLoadError(
        f"{source}: no config.json and {len(ggufs)} .gguf files; expected a Hugging Face model "
        "folder or a folder with exactly one .gguf file."
    )
