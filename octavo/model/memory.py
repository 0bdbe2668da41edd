"""Host memory in huge pages for the large tensors that live as long as the engine.

Linux hands out memory in 4 KiB pages unless a range is marked for transparent huge pages
(`madvise`, the usual default of /sys/kernel/mm/transparent_hugepage/enabled, which torch's
allocator never asks for). The paged KV cache is read a block at a time at scattered places of
a pool of hundreds of MB, so with 4 KiB pages nearly every block costs TLB misses and page walks
(two-level ones in a virtual machine); 2 MiB pages cover the same pool with a few hundred TLB
entries. `empty` maps such a range, aligned to 2 MiB, and asks for huge pages; where the system
cannot give them (another OS, THP set to `never`, a non-CPU device, a tensor below 2 MiB) it is
plain `torch.empty`, with the same contract.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20


def huge_pages_supported(device: torch.device | str = "cpu") -> bool:
    """Whether `empty` can ask for huge pages here: CPU tensors on a system with madvise's
    MADV_HUGEPAGE."""
    return torch.device(device).type == "cpu" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    huge_pages: bool = True,
) -> Tensor:
    """An uninitialised contiguous tensor like torch.empty(shape, dtype=dtype, device=device),
    on CPU in anonymous memory marked for transparent huge pages and starting on a 2 MiB
    boundary (unless `huge_pages` is False: the `huge_pages` setting). The tensor keeps its
    mapping alive; the mapping is freed with the tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages or nbytes < HUGE_PAGE_BYTES or not huge_pages_supported(device):
        return torch.empty(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def empty_many(
    specs: list[tuple[tuple[int, ...], torch.dtype]],
    device: torch.device | str = "cpu",
    align: int = 64,
    huge_pages: bool = True,
) -> list[Tensor]:
    """Uninitialised contiguous tensors of the given (shape, dtype)s laid one after another (each
    on an `align`-byte boundary) in one `empty` allocation, so that many tensors below 2 MiB
    each, such as a model's packed weights, share huge pages. Each keeps the allocation alive."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // align) * align
    arena = empty((end,), torch.uint8, device, huge_pages)
    return [
        arena[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), offset in zip(specs, offsets)
    ]
