"""The machine as the engine sees it: the torch device, native bfloat16, the default KV budget.

`probe_platform` turns these into PlatformInfo, plain data from which octavo.config resolves
the settings; `TORCH_DTYPES` maps the resolved dtype names back to torch's.
"""

from __future__ import annotations

import os

import torch

from octavo.config import PlatformInfo

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


def probe_platform(device: str) -> PlatformInfo:
    """The facts octavo.config needs about the machine for the `device` setting."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        native = "GPU" if torch.cuda.is_bf16_supported() else ""
    else:
        native = ", ".join(sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}))
    return PlatformInfo(
        device=str(resolved),
        device_type=resolved.type,
        native_bf16=native,
        default_kv_cache_bytes=default_kv_cache_bytes(resolved),
        total_memory_bytes=total_memory_bytes(resolved),
    )


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return _meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory: a GPU's, or the host's RAM (MemTotal)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes; 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_kv_cache_bytes(device: torch.device) -> int:
    available = available_memory_bytes(device)
    if device.type == "cuda":
        return int(available * _GPU_KV_SHARE)
    return min(int(available * _CPU_KV_SHARE), _CPU_KV_CAP_BYTES)


def split_cpus(num_shares: int, equal: bool = False) -> list[list[int] | None]:
    """The CPUs this process may use in `num_shares` contiguous shares (data-parallel
    replicas, tensor-parallel ranks); the first ones get a CPU more where they do not divide,
    unless `equal` (the leftover CPUs then go unused). None (every CPU, shared) for one share,
    or for all of them when there are fewer CPUs than shares."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_shares == 1 or len(cpus) < num_shares:
        return [None] * num_shares
    share, extra = divmod(len(cpus), num_shares)
    if equal:
        extra = 0
    shares, begin = [], 0
    for index in range(num_shares):
        end = begin + share + (index < extra)
        shares.append(cpus[begin:end])
        begin = end
    return shares
