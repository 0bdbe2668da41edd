"""Building an engine's worker side: what it must know before resolving the settings (the
machine, the model's config), then the backend, the model and the runner for an EngineConfig.

The resolution itself (EngineArgs -> EngineConfig) is octavo.config's; this module gathers the
facts it needs and builds what the resolved config says, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.config import EngineArgs, EngineConfig, PlatformInfo
from octavo.model.backends import ModelBackend, select_backend
from octavo.model.config import ModelConfig
from octavo.model.loader import load_model, read_model_config, resolve_model_path
from octavo.worker.device import TORCH_DTYPES, probe_platform
from octavo.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class EngineFacts:
    """What the settings are resolved against."""

    platform: PlatformInfo
    model_path: str
    model_config: ModelConfig


def probe(args: EngineArgs) -> EngineFacts:
    """The machine and the model's config (headers only: no weights are read)."""
    model_path = resolve_model_path(args.model)
    return EngineFacts(probe_platform(args.device), model_path, read_model_config(model_path))


def build_model_runner(config: EngineConfig) -> tuple[ModelRunner, ModelBackend]:
    """The backend select_backend picks for the config, the model loaded with it, and the
    runner over them (which allocates the KV cache)."""
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    backend = select_backend(
        device, TORCH_DTYPES[config.dtype], TORCH_DTYPES[config.cache.dtype], config.backend
    )
    model, model_config = load_model(config.model, backend)
    runner = ModelRunner(model, model_config, config.cache, config.scheduler, backend)
    return runner, backend
