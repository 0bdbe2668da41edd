"""Device and dtype choice, and how much memory the KV cache may take by default."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Default KV budget on a CPU host: a share of available memory, capped (vLLM's CPU backend
# defaults to 4 GiB of KV space).
_CPU_KV_SHARE = 0.25
_CPU_KV_CAP_BYTES = 4 << 30
# On an accelerator, the share of free device memory left after the weights are loaded.
_GPU_KV_SHARE = 0.8


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a valid torch device.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but CUDA is not available.")
    return resolved


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """Returns the dtype and the reason for it (logged at start-up)."""
    if dtype != "auto":
        return _DTYPES[dtype], f"dtype={dtype} was asked for"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bfloat16"
        return torch.float16, "auto: the GPU lacks bfloat16, float16 instead"
    native = cpu_flags() & {"avx512_bf16", "amx_bf16"}
    if native:
        return torch.bfloat16, f"auto: the CPU has native bfloat16 ({', '.join(sorted(native))})"
    return torch.float32, "auto: the CPU has no native bfloat16 (no AVX512-BF16/AMX), so float32"


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_kv_cache_bytes(device: torch.device) -> int:
    available = available_memory_bytes(device)
    if device.type == "cuda":
        return int(available * _GPU_KV_SHARE)
    return min(int(available * _CPU_KV_SHARE), _CPU_KV_CAP_BYTES)
