"""Hugging Face folders: config.json (+ generation_config.json) and *.safetensors weights, or
PyTorch's *.bin ones where a folder has no safetensors.

Owns reading the config files into a ModelConfig and streaming (name, tensor) pairs out of the
weight files, single or sharded (model.safetensors.index.json, pytorch_model.bin.index.json);
.bin files are read by torch's safe loading (weights_only: tensors only, no code runs) with the
file mapped, not copied. Every file is opened once
up front so that a truncated or corrupt one fails before the model is built. Must not know model
classes or parameter layouts: names go out as stored, with the substitutions an architecture's
spec lists (ArchSpec.hf_renames) applied; a checkpoint quantized by GPTQ, AWQ or
compressed-tensors has each layer's integer parts turned into block weights on the way
(hf_quantized.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from octavo.model.arch import get_spec
from octavo.model.config import ModelConfig
from octavo.model.loader.errors import ModelLoadError
from octavo.model.loader.hf_quantized import read_scheme, repack

_INDEX_FILE = "model.safetensors.index.json"
_BIN_INDEX_FILE = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class HFConfigSource:
    """Where a Hugging Face folder's config.json is read from, and which of its keys are
    replaced before the ModelConfig is built (vLLM's --hf-config-path and --hf-overrides)."""

    # A local folder holding the config.json to read instead of the model's ("": the model's).
    folder: str = ""
    # Keys replacing the config's; a dict under a key whose value is a sub-config (a dict
    # named *_config, such as text_config) replaces that sub-config's keys one by one.
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.folder or self.overrides)


def apply_hf_overrides(config: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `overrides`' keys (HFConfigSource.overrides' rule); `config` is not
    changed."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        if key.endswith("_config") and isinstance(current, dict) and isinstance(value, dict):
            merged[key] = {**current, **value}
        else:
            merged[key] = value
    return merged


def open_hf_checkpoint(
    folder: Path, source: HFConfigSource | None = None
) -> tuple[ModelConfig, Iterator[tuple[str, Tensor]]]:
    """(config, lazy iterator over every tensor of every safetensors file); the config from
    `source`'s folder, with its overrides, where given. Raises ModelLoadError for unreadable
    config files, no or missing weight files, a corrupt header."""
    source = source or HFConfigSource()
    config_path = Path(source.folder or folder) / "config.json"
    if source.folder and not config_path.is_file():
        raise ModelLoadError(f"hf_config_path {source.folder!r} holds no config.json.")
    config_dict = apply_hf_overrides(_read_json(config_path), source.overrides)
    scheme = None
    if config_dict.get("quantization_config") is not None:
        scheme = read_scheme(config_dict["quantization_config"], str(folder))
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    try:
        config = ModelConfig.from_hf_config(config_dict, generation)
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}{_with(source)}: {exc}") from None
    files = weight_files(folder)
    for file in files:
        _check_header(file)
    renames = get_spec(config.architecture).hf_renames
    tensors: Iterator[tuple[str, Any]] = _iter_tensors(files)
    if renames:
        tensors = _renamed(tensors, renames)
    if scheme is not None:
        config = dataclasses.replace(
            config, weight_block_types=scheme.block_types, quantization_method=scheme.method
        )
        tensors = repack(tensors, scheme)
    return config, tensors


def _with(source: HFConfigSource) -> str:
    return f" with hf_overrides {dict(source.overrides)}" if source.overrides else ""


def _renamed(
    tensors: Iterator[tuple[str, Tensor]], renames: tuple[tuple[str, str], ...]
) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors under octavo's module names (ArchSpec.hf_renames)."""
    for name, tensor in tensors:
        for old, new in renames:
            name = name.replace(old, new)
        yield name, tensor


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards an index lists, else every *.safetensors, else
    every PyTorch *.bin (the same order for those)."""
    index_path = folder / _INDEX_FILE
    if not index_path.is_file() and not any(folder.glob("*.safetensors")):
        index_path = folder / _BIN_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no 'weight_map' entries.")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index_path} lists shard {file.name!r}, which is missing.")
        return files
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors or PyTorch .bin weight files.")
    return files


def _load_bin(file: Path) -> dict[str, Tensor]:
    """A PyTorch .bin state dict, tensors only (weights_only: no pickled code runs), mapped."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be mapped: read it whole
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle, zip and runtime errors alike
        raise ModelLoadError(f"{file}: cannot read a PyTorch state dict ({exc}).") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file}: not a state dict of tensors.")
    return state


def _check_header(file: Path) -> None:
    if file.suffix == ".bin":
        _load_bin(file)
        return
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            handle.keys()
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({exc}).") from None


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    for file in files:
        if file.suffix == ".bin":
            yield from _load_bin(file).items()
            continue
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read tensors ({exc}).") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object.")
    return data
