"""Turns EngineArgs into a running engine's parts: model path, device, dtype, KV capacity.

Every effective setting is decided here once, frozen into an EngineConfig and logged as one
JSON document, followed by the KV capacity line users size their deployments by.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from octavo.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    SchedulerConfig,
    load_chat_template,
)
from octavo.model.config import ModelConfig
from octavo.model.kv_cache import kv_cache_bytes_per_token
from octavo.model.loader import find_default_model, load_model
from octavo.worker.device import default_kv_cache_bytes, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# On a CPU a step's time grows with every prompt token it carries (~1 ms per token for the
# embedded model on two cores), so a prompt taking the whole 2,048-token budget freezes every
# running stream for seconds. With a cap per prompt and step, the prompts that arrive together
# advance together, and one that arrives while others decode delays them by one chunk's time
# (BENCHMARKS.md, "Prompt chunks while decoding"). 256 rather than 128: a 256-token prompt then
# runs in one step, as do D's 256 new tokens per prompt (its p99 TTFT 2.4 s instead of 2.7-3.4),
# with C's and D's p99 ITL unchanged ("The prompt cap at 256").
DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD = 256
# Tokens per KV block on a CPU (vLLM's CPU default too). Decode attention reads a request's
# blocks from wherever they lie in the pool; 128 tokens make each block's keys a contiguous
# run of 96 KB (the embedded model, float32), where 16 tokens make 12 KB runs that the memory
# system streams less well: a decode step of 32 requests at 320 tokens ~5% faster
# (BENCHMARKS.md, "Decode attention in sixteen lanes, huge pages, 128-token blocks"). GPUs
# keep 16.
DEFAULT_CPU_BLOCK_SIZE = 128


@dataclass(frozen=True)
class LoadedModel:
    config: EngineConfig
    model: nn.Module
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    model_path: str


def resolve_model_path(model: str | None) -> str:
    """None means the embedded default; a folder holding exactly one .gguf means that file."""
    path = find_default_model() if model is None else os.path.expanduser(model)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
    return path


def load_engine_parts(args: EngineArgs) -> LoadedModel:
    model_path = resolve_model_path(args.model)
    device = resolve_device(args.device)
    dtype, dtype_reason = resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    model, model_config = load_model(model_path, dtype, device)

    kv_cache_dtype = (
        dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, device)[0]
    )
    bytes_per_token = kv_cache_bytes_per_token(model_config, kv_cache_dtype)
    block_size = args.block_size or (DEFAULT_CPU_BLOCK_SIZE if device.type == "cpu" else 16)
    num_blocks = _num_kv_blocks(args, block_size, bytes_per_token, device)
    capacity = num_blocks * block_size
    max_model_len = _max_model_len(args, model_config, capacity)
    config = EngineConfig(
        model=model_path,
        served_model_name=args.served_model_name or _default_name(args.model, model_path),
        dtype=str(dtype).removeprefix("torch."),
        dtype_reason=dtype_reason,
        device=str(device),
        seed=args.seed,
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            bytes_per_token=bytes_per_token,
            dtype=str(kv_cache_dtype).removeprefix("torch."),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            long_prefill_token_threshold=_long_prefill_token_threshold(args, device),
            max_model_len=max_model_len,
            admission=args.admission,
            watermark=args.watermark,
            preempt_victim=args.preempt_victim,
        ),
        request_log=args.request_log,
        chat_template=load_chat_template(args.chat_template),
    )
    logger.info("dtype %s (%s)", config.dtype, dtype_reason)
    logger.info("resolved configuration: %s", config.to_json())
    logger.info(capacity_line(config.cache, max_model_len))
    return LoadedModel(config, model, model_config, device, dtype, kv_cache_dtype, model_path)


def capacity_line(cache: CacheConfig, max_model_len: int) -> str:
    mib = cache.num_tokens * cache.bytes_per_token / (1 << 20)
    fit = cache.num_tokens // max_model_len
    return (
        f"KV cache: {cache.num_blocks} blocks x {cache.block_size} tokens = "
        f"{cache.num_tokens} tokens ({mib:.1f} MiB, {cache.dtype or 'no model'}); "
        f"{fit} requests of max_model_len ({max_model_len}) fit"
    )


def _long_prefill_token_threshold(args: EngineArgs, device: torch.device) -> int:
    if args.long_prefill_token_threshold is not None:
        return args.long_prefill_token_threshold
    return DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD if device.type == "cpu" else 0


def _num_kv_blocks(
    args: EngineArgs,
    block_size: int,
    bytes_per_token: int,
    device: torch.device,
) -> int:
    block_bytes = bytes_per_token * block_size
    if args.kv_cache_tokens is not None:
        return -(-args.kv_cache_tokens // block_size)
    budget = args.kv_cache_memory_bytes or default_kv_cache_bytes(device)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={budget} is smaller than one block ({block_bytes} bytes)."
        )
    return num_blocks


def _max_model_len(args: EngineArgs, model_config: ModelConfig, capacity: int) -> int:
    model_max = model_config.max_position_embeddings
    if args.max_model_len is None:
        # Fit the model's context into the pool when the user left it to us.
        return min(model_max, capacity)
    if args.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={args.max_model_len} exceeds the model's context length {model_max}."
        )
    if args.max_model_len > capacity:
        raise ValueError(
            f"max_model_len={args.max_model_len} does not fit in the KV cache ({capacity} "
            "tokens): raise kv_cache_tokens / kv_cache_memory_bytes or lower max_model_len."
        )
    return args.max_model_len


def _default_name(model: str | None, model_path: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/")
