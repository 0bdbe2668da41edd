"""Model loading: a checkpoint path -> a model with its weights on a device, plus its config.

Owns deciding what a path holds (a Hugging Face folder with safetensors, or a GGUF file), building
the model without initialising weights it is about to overwrite, and turning every failure into
one ModelLoadError with a message that names the path and the problem. File formats live in
`safetensors.py` and `gguf.py`; model code never reads files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from octavo.config import QUANTIZATIONS, sampling_defaults_from
from octavo.model.arch import get_spec, load_model_class
from octavo.model.backends import ModelBackend
from octavo.model.config import ModelConfig
from octavo.model.formats.ggml import QuantizedTensor, quantize
from octavo.model.layers.embedding import VocabEmbedding
from octavo.model.layers.linear import Linear
from octavo.model.loader.errors import ModelLoadError
from octavo.model.loader.gguf import (
    find_default_model,
    open_gguf_checkpoint,
    read_gguf_chat_template,
)
from octavo.model.loader.hf_quantized import METHODS as HF_METHODS
from octavo.model.loader.hub import TOKENIZER_PATTERNS, looks_like_repo_id, snapshot_folder
from octavo.model.loader.quantization import QuantizationPlan
from octavo.model.loader.safetensors import HFConfigSource, open_hf_checkpoint
from octavo.model.parallel import TRIVIAL, TPGroup, shard_model
from octavo.model.pooling import POOLING_TYPES, as_embedding_model, embedding_weights

logger = logging.getLogger(__name__)

__all__ = [
    "QUANTIZATIONS",
    "HFConfigSource",
    "ModelLoadError",
    "build_model",
    "find_default_model",
    "load_model",
    "read_generation_defaults",
    "read_gguf_chat_template",
    "read_model_config",
    "read_st_pooling",
    "resolve_hf_config_path",
    "resolve_model_path",
    "resolve_tokenizer_path",
]

GENERATION_CONFIG_FILE = "generation_config.json"


def resolve_model_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    allow_patterns: list[str] | None = None,
    token: str | bool | None = None,
) -> str:
    """None means the embedded default; a folder holding exactly one .gguf (and no
    config.json) means that file; `org/name` that is no local path, a Hugging Face Hub
    repository's snapshot at `revision` (hub.py: from the cache in download_dir or
    huggingface_hub's, or downloaded with `token`; only the files `allow_patterns` match,
    default those a model needs)."""
    if model is not None and looks_like_repo_id(model):
        return snapshot_folder(model, revision, download_dir, allow_patterns, token)
    path = find_default_model() if model is None else os.path.expanduser(model)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
    return path


def resolve_tokenizer_path(
    tokenizer: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | bool | None = None,
) -> str:
    """--tokenizer: a folder or .gguf file (a folder of one .gguf, that file), or a Hub id's
    snapshot of its tokenizer files (no weights) at `revision`. Raises ModelLoadError for a
    local path that does not exist."""
    path = resolve_model_path(tokenizer, revision, download_dir, TOKENIZER_PATTERNS, token)
    if not os.path.exists(path):
        raise ModelLoadError(f"Tokenizer path {tokenizer!r} does not exist.")
    return path


def read_generation_defaults(
    source: str, download_dir: str | None = None, token: str | bool | None = None
) -> dict[str, Any]:
    """--generation-config FOLDER: the sampling defaults (SamplingParams names) of the
    generation_config.json in that folder (or a Hub id's snapshot of it), or of that file
    itself. A folder without one gives none, with a warning (vLLM then uses none either).
    Raises ModelLoadError for a path that does not exist or a file that is not a JSON object."""
    path = Path(resolve_model_path(source, None, download_dir, [GENERATION_CONFIG_FILE], token))
    if not path.exists():
        raise ModelLoadError(f"generation_config {source!r} does not exist.")
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
        if not path.is_file():
            logger.warning(
                "generation_config %r has no %s: no sampling defaults",
                source,
                GENERATION_CONFIG_FILE,
            )
            return {}
    try:
        generation_config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable JSON file ({exc}).") from None
    if not isinstance(generation_config, dict):
        raise ModelLoadError(f"{path}: not a JSON object.")
    return sampling_defaults_from(generation_config)


def resolve_hf_config_path(
    hf_config_path: str,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | bool | None = None,
) -> str:
    """--hf-config-path: the local folder of a folder or Hub id (its config.json only, at
    `revision`) that holds a config.json. Raises ModelLoadError where it holds none."""
    folder = resolve_model_path(hf_config_path, revision, download_dir, ["config.json"], token)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelLoadError(f"hf_config_path {hf_config_path!r} holds no config.json.")
    return folder


# sentence-transformers' module types (modules.json) that say how a folder pools.
_ST_POOLING_TYPES = frozenset(
    {
        "sentence_transformers.models.Pooling",
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    }
)
_ST_NORMALIZE_TYPES = frozenset(
    {
        "sentence_transformers.models.Normalize",
        "sentence_transformers.base.modules.normalize.Normalize",
        "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
    }
)


def read_st_pooling(path: str) -> dict[str, Any] | None:
    """What a sentence-transformers folder's modules.json says of its pooling, as
    --pooler-config keys: `use_activation` (a Normalize module follows the pooling),
    `pooling_type` (from its Pooling module's config.json: pooling_mode or the
    pooling_mode_* flag set; lasttoken is LAST), absent where that says nothing octavo knows.
    None for a file or a folder without modules.json."""
    folder = Path(path)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    config: dict[str, Any] = {
        "use_activation": any(m.get("type") in _ST_NORMALIZE_TYPES for m in modules)
    }
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING_TYPES), None)
    pooling_path = folder / (pooling or {}).get("path", "") / "config.json"
    if pooling is None or not pooling_path.is_file():
        return config
    for key, value in json.loads(pooling_path.read_text()).items():
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif key.startswith("pooling_mode_") and value is True:
            name = key.removeprefix("pooling_mode_")
        else:
            continue
        name = "LAST" if name.startswith("lasttoken") else name.split("_")[0].upper()
        if name in POOLING_TYPES:
            config["pooling_type"] = name
        else:
            config.setdefault("pooling_type", name)  # refused by config.resolve_runner
    return config


def read_model_config(path: str, hf_config: HFConfigSource | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint, without reading its weights (headers only). Raises
    ModelLoadError as load_model does."""
    return _open_checkpoint(_existing(path), hf_config)[0]


def load_model(
    path: str,
    backend: ModelBackend,
    quantization: str | None = None,
    tp: TPGroup = TRIVIAL,
    hf_config: HFConfigSource | None = None,
    embed: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Load a Hugging Face folder (config.json and *.safetensors, sharded ones through
    model.safetensors.index.json) or a .gguf file (or a folder holding exactly one .gguf).
    `quantization` (one of QUANTIZATIONS): "gguf" keeps a GGUF file's block types (as without
    it); a block type's or a mix's name quantizes the float matrices of a float checkpoint as
    they are read (loader/quantization.py has the plan).

    Returns the model in eval mode, built with `backend`'s ops, every parameter in its compute
    dtype on its device and every linear weight in the format it chose, and the config. Raises
    ModelLoadError for a missing path, an unsupported architecture, RoPE type or GGUF tensor
    type, a truncated or corrupt file, missing or unexpected tensors, and a quantization (or
    an `hf_config`: a Hugging Face folder's config from elsewhere or with keys replaced) that
    does not apply to the checkpoint. `embed`: the model is an embedder (a pooling runner's):
    a causal LM without its head, its checkpoint's tensor names as model/pooling.py reads
    them. With a `tp` group of more than one rank, the loaded model
    is cut to this rank's share (model/parallel.py) before its weights get their formats.
    """
    source = _existing(path)
    start_s = time.perf_counter()
    config, weights = _open_checkpoint(source, hf_config)
    if quantization is not None:
        weights = _quantize_weights(path, source, config, weights, quantization)
    try:
        model = build_model(config, backend)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if embed and hasattr(model, "lm_head"):
        model = as_embedding_model(model)
        weights = embedding_weights(weights)
    try:
        model.load_weights(weights)
    except ModelLoadError:
        raise
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    if tp.size > 1:
        try:
            shard_model(model, tp)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
    backend.prepare_model(model)
    num_params = sum(param.numel() for param in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM parameters, %s on %s) in %.1f s",
        path,
        config.architecture,
        num_params / 1e6,
        backend.dtype,
        backend.device,
        time.perf_counter() - start_s,
    )
    return model.eval(), config


def _quantize_weights(
    path: str,
    source: Path,
    config: ModelConfig,
    weights: Iterable[tuple[str, Tensor | QuantizedTensor]],
    quantization: str,
) -> Iterable[tuple[str, Tensor | QuantizedTensor]]:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization={quantization!r} is not supported (choose from "
            f"{', '.join(QUANTIZATIONS)})."
        )
    is_gguf = not (source / "config.json").is_file()
    if quantization == "gguf":
        if not is_gguf:
            raise ModelLoadError(f"{path}: quantization='gguf' needs a GGUF file.")
        return weights
    if quantization in HF_METHODS:
        if config.quantization_method != quantization:
            found = config.quantization_method or "not quantized by such a method"
            raise ModelLoadError(
                f"{path}: quantization={quantization!r} names the checkpoint's own method, and "
                f"this checkpoint is {found}; leave --quantization out to read it as it is."
            )
        return weights
    if config.weight_block_types:
        raise ModelLoadError(
            f"{path}: quantization={quantization!r} quantizes float weights, and this "
            f"checkpoint's are already in {', '.join(config.weight_block_types)}; serve it as "
            "it is."
        )
    plan = QuantizationPlan(quantization, config.num_hidden_layers, config.tie_word_embeddings)
    return _quantized(weights, plan)


def _quantized(
    weights: Iterable[tuple[str, Tensor | QuantizedTensor]], plan: QuantizationPlan
) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
    """Every float matrix (linear weights, embeddings) in the block type `plan` gives it;
    vectors (norms, biases) and matrices it leaves float as they are."""
    for name, tensor in weights:
        qtype = plan.type_for(name, tuple(tensor.shape)) if isinstance(tensor, Tensor) else None
        yield name, tensor if qtype is None else quantize(tensor, qtype)


def build_model(config: ModelConfig, backend: ModelBackend) -> nn.Module:
    """The model class for config.architecture, built with `backend`'s ops, with parameters
    allocated (not initialised) in the backend's dtype on its device, requires_grad off
    (inference only); the caller must load every weight, then call backend.prepare_model.
    Raises ModelLoadError for an unsupported architecture or one the backend cannot run."""
    try:
        model_class = load_model_class(get_spec(config.architecture))
        # Built on the meta device: random initialisation of weights that are overwritten
        # anyway costs seconds for a large model, and a float32 copy before the cast would
        # double memory.
        with torch.device("meta"):
            model = model_class(config, backend)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    dtype, device = backend.dtype, backend.device
    # Parameters are replaced by hand rather than with Module.to_empty, whose meta-tensor
    # dispatch imports torch's symbolic-shape machinery (over a second of start-up).
    # Weight matrices in the backend's weight dtype where it has one; norms, biases and
    # everything else in the compute dtype.
    matrix_dtype = backend.weight_dtype or dtype
    for module in model.modules():
        matrices = isinstance(module, (Linear, VocabEmbedding))
        if isinstance(module, VocabEmbedding):
            module.output_dtype = dtype
        for name, param in list(module.named_parameters(recurse=False)):
            param_dtype = matrix_dtype if matrices and name == "weight" else dtype
            empty = torch.empty(param.shape, dtype=param_dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))
    return model


def _existing(path: str) -> Path:
    source = Path(path)
    if not source.exists():
        raise ModelLoadError(f"Model path {path!r} does not exist.")
    return source


def _open_checkpoint(
    source: Path, hf_config: HFConfigSource | None = None
) -> tuple[ModelConfig, Iterable[tuple[str, Tensor]]]:
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelLoadError(f"{source}: expected a .gguf file or a Hugging Face model folder.")
        return _open_gguf(source, hf_config)
    if (source / "config.json").is_file():
        return open_hf_checkpoint(source, hf_config)
    ggufs = sorted(source.glob("*.gguf"))
    if len(ggufs) == 1:
        return _open_gguf(ggufs[0], hf_config)
    raise ModelLoadError(
        f"{source}: no config.json and {len(ggufs)} .gguf files; expected a Hugging Face model "
        "folder or a folder with exactly one .gguf file."
    )


def _open_gguf(
    path: Path, hf_config: HFConfigSource | None
) -> tuple[ModelConfig, Iterable[tuple[str, Tensor]]]:
    """A GGUF file's config is built from its metadata, never from a config.json: neither
    --hf-config-path nor --hf-overrides has a config dict to act on there."""
    if hf_config:
        raise ModelLoadError(
            f"{path}: hf_config_path and hf_overrides apply to a Hugging Face folder's "
            "config.json; a GGUF file's config is read from its metadata. Serve the model's "
            "Hugging Face folder (or its float checkpoint with --quantization) to change it."
        )
    return open_gguf_checkpoint(path)
