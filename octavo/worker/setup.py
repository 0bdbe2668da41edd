"""Building an engine's worker side: what it must know before resolving the settings (the
machine, the model's config), then the backend, the model and the runner for an EngineConfig.

The resolution itself (EngineArgs -> EngineConfig) is octavo.config's; this module gathers the
facts it needs and builds what the resolved config says, nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octavo.config import (
    GENERATION_CONFIG_SOURCES,
    EngineArgs,
    EngineConfig,
    PlatformInfo,
    resolve_speculative_config,
)
from octavo.model.backends import ModelBackend, select_backend
from octavo.model.config import ModelConfig
from octavo.model.loader import (
    HFConfigSource,
    load_model,
    read_generation_defaults,
    read_model_config,
    read_st_pooling,
    resolve_hf_config_path,
    resolve_model_path,
    resolve_tokenizer_path,
)
from octavo.model.loader.safetensors import weight_files
from octavo.model.parallel import TRIVIAL, TPGroup, incompatibility, rank_model_config
from octavo.worker.device import TORCH_DTYPES, probe_platform
from octavo.worker.drafter import Drafter
from octavo.worker.model_runner import ModelRunner

# torch's bfloat16 matmuls on a CPU go through oneDNN, and two caches keep what each matmul
# shape built, 1,024 shapes each by default: oneDNN's primitives and ideep's own cache over
# them (LRU_CACHE_CAPACITY). With prompt chunks of every length that is ~1.6 MB a new shape,
# never given back (a soak of varied requests grew ~70 MiB a round without levelling off; 300
# more shapes of one matmul after 300: +403 MiB by default, +61 MiB capped at 32, +10 MiB at 8,
# offline throughput the same at 8 and 32 within noise). A shape that returns is built again
# in a fraction of a millisecond; decode batches take the packed kernel, not oneDNN. Both are
# read at the first bfloat16 matmul, so they are set before the model is loaded (its timing
# of the matmuls is that first use); values already in the environment win.
MATMUL_SHAPE_CACHE_CAPACITY = 8


@dataclass(frozen=True)
class EngineFacts:
    """What the settings are resolved against."""

    platform: PlatformInfo
    model_path: str
    model_config: ModelConfig
    # Bytes of the model's weight files (what gpu_memory_utilization leaves the KV cache less).
    weight_bytes: int = 0
    # The resolved --tokenizer ("": the model's own).
    tokenizer_path: str = ""
    # The sampling defaults of a --generation-config folder (None: the model's own, or none).
    generation_defaults: dict[str, Any] | None = None
    # The resolved --hf-config-path ("": the model's config.json).
    hf_config_path: str = ""
    # A sentence-transformers folder's pooling (read_st_pooling; None: not one).
    st_pooling: dict[str, Any] | None = None
    # speculative_config's draft model (method draft_model): its resolved path and config.
    draft_model_path: str = ""
    draft_model_config: ModelConfig | None = None


def bound_matmul_shape_caches() -> None:
    """Cap the per-shape caches of torch's bfloat16 CPU matmuls (see above); call before the
    process's first such matmul."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(MATMUL_SHAPE_CACHE_CAPACITY))


def probe(args: EngineArgs) -> EngineFacts:
    """The machine and the model's config (headers only: no weights are read). Raises
    ValueError for a tensor_parallel_size the model does not split over."""
    token = args.hf_token
    model_path = resolve_model_path(args.model, args.revision, args.download_dir, token=token)
    hf_config_path = ""
    if args.hf_config_path is not None:
        hf_config_path = resolve_hf_config_path(
            args.hf_config_path, args.revision, args.download_dir, token
        )
    hf_config = HFConfigSource(hf_config_path, args.hf_overrides or {})
    model_config = read_model_config(model_path, hf_config)
    reason = incompatibility(model_config, args.tensor_parallel_size)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}: {reason}.")
    tokenizer_path = ""
    if args.tokenizer is not None:
        revision = args.tokenizer_revision or args.revision
        tokenizer_path = resolve_tokenizer_path(args.tokenizer, revision, args.download_dir, token)
    generation_defaults = None
    if args.generation_config not in GENERATION_CONFIG_SOURCES:
        generation_defaults = read_generation_defaults(
            args.generation_config, args.download_dir, token
        )
    draft_path, draft_config = "", None
    speculative = resolve_speculative_config(args.speculative_config)
    if speculative is not None and speculative.drafts_by_model:
        draft_path = resolve_model_path(speculative.model, None, args.download_dir, token=token)
        draft_config = read_model_config(draft_path)
    return EngineFacts(
        probe_platform(args.device),
        model_path,
        model_config,
        weight_file_bytes(model_path),
        tokenizer_path,
        generation_defaults,
        hf_config_path,
        read_st_pooling(model_path),
        draft_path,
        draft_config,
    )


def weight_file_bytes(model_path: str) -> int:
    """The bytes of a model's weights on disk: a GGUF file, or the weight files the loader
    reads of a folder (the shards its index lists; safetensors where there are both)."""
    if os.path.isfile(model_path):
        return os.path.getsize(model_path)
    return sum(file.stat().st_size for file in weight_files(Path(model_path)))


def build_model_runner(
    config: EngineConfig,
) -> tuple[ModelRunner, ModelBackend, EngineConfig]:
    """The backend select_backend picks for the config, the model loaded with it, and the
    runner over them (which allocates the KV cache); with tensor_parallel_size > 1, the
    executor over that many ranks that `distributed_executor_backend` names
    (worker/executor.py), with rank 0's backend. Also the config the engine runs by: `config`,
    or under an external launcher the one every rank agreed on."""
    if config.tensor_parallel_size > 1:
        from octavo.worker import executor as executors

        kind = {
            "ray": executors.RayExecutor,
            "external_launcher": executors.ExternalLauncherExecutor,
        }.get(config.distributed_executor_backend or "mp", executors.MultiprocExecutor)
        executor = kind(config)
        agreed = getattr(executor, "config", config)
        return executor, executor.backend, agreed  # type: ignore[return-value]
    runner, backend = build_rank_runner(config, TRIVIAL)
    return runner, backend, config


def build_rank_runner(config: EngineConfig, tp: TPGroup) -> tuple[ModelRunner, ModelBackend]:
    """One tensor-parallel rank's: its model share and a runner whose KV cache holds its
    heads (the whole model for the trivial group)."""
    bound_matmul_shape_caches()
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    backend = select_backend(
        device,
        TORCH_DTYPES[config.dtype],
        TORCH_DTYPES[config.cache.dtype],
        config.backend,
        TORCH_DTYPES[config.weight_dtype] if config.weight_dtype else None,
    )
    hf_config = HFConfigSource(config.hf_config_path, config.hf_overrides)
    embed = config.is_pooling
    model, model_config = load_model(
        config.model, backend, config.quantization, tp, hf_config, embed
    )

    def reload_model() -> nn.Module:
        return load_model(config.model, backend, config.quantization, tp, hf_config, embed)[0]

    drafter = None
    speculative = config.speculative
    if speculative is not None and speculative.drafts_by_model:
        assert speculative.model and tp.size == 1, speculative
        # prepare_model reports on the model it prepared last: keep the target's report, with
        # the draft's beside it.
        report, fused_layer = backend.weights_report, backend.fused_decode_layer
        draft, draft_config = load_model(speculative.model, backend, speculative.quantization)
        draft_report = {
            "path": speculative.model,
            "bytes_by_type": backend.weights_report.get("bytes_by_type", {}),
            "fused_decode_layer": backend.fused_decode_layer,
        }
        backend.weights_report = {**report, "draft_model": draft_report}
        backend.fused_decode_layer = fused_layer
        drafter = Drafter(draft, draft_config, config.cache, backend, speculative)
    runner = ModelRunner(
        model,
        rank_model_config(model_config, tp.size),
        config.cache,
        config.scheduler,
        backend,
        reload_model if config.enable_sleep_mode else None,
        config.logprobs_mode,
        config.pooler,
        drafter,
    )
    return runner, backend
