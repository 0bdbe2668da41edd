"""Huge-page host memory for the KV cache: the same contract as torch.empty, on a 2 MiB boundary."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from octavo.model import memory
from octavo.model.kv_cache import allocate_kv_cache

pytestmark = pytest.mark.skipif(not memory.huge_pages_supported(), reason="no MADV_HUGEPAGE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensor_starts_on_a_huge_page_and_behaves_like_empty(dtype):
    shape = (2, 300, 16, 3, 64)  # 7.0 MiB in float32: not a whole number of huge pages
    t = memory.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE_BYTES == 0
    expected = torch.arange(t.numel(), dtype=torch.float32).remainder(251).to(dtype).view(shape)
    t.copy_(expected)
    assert torch.equal(t, expected)
    assert torch.equal(t[1, 299], expected[1, 299])  # the last bytes are the tensor's own


def test_tensor_keeps_its_mapping_alive():
    t = memory.empty((1 << 20,), torch.float32)  # 4 MiB
    t.fill_(3.0)
    gc.collect()
    assert t.sum().item() == 3.0 * (1 << 20)


def test_small_tensors_and_disabled_huge_pages_take_torch_empty():
    small = memory.empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and small.untyped_storage().nbytes() == 16 * 16 * 4
    # huge_pages=False: the `huge_pages` setting turned off.
    big = memory.empty((1 << 20,), torch.float32, huge_pages=False)
    assert big.untyped_storage().nbytes() == (1 << 22)  # no extra room for alignment
    (many,) = memory.empty_many([((1 << 20,), torch.float32)], huge_pages=False)
    assert many.untyped_storage().nbytes() == (1 << 22)


def test_many_tensors_share_one_allocation_without_overlap():
    specs = [((100, 3), torch.bfloat16), ((5, 7, 32), torch.float32), ((1,), torch.bfloat16)]
    tensors = memory.empty_many(specs, align=64)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == specs
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert torch.all(t == i + 1)  # no later tensor wrote over an earlier one
    assert memory.empty_many([]) == []


def test_kv_cache_is_zeroed_and_on_huge_page_boundaries():
    # The three fields the allocation reads.
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    caches = allocate_kv_cache(
        config, num_blocks=2048, block_size=16, dtype=torch.float32, device="cpu"
    )
    assert len(caches) == 2
    for cache in caches:
        assert cache.shape == (2, 2048, 16, 2, 16)
        assert cache.data_ptr() % memory.HUGE_PAGE_BYTES == 0
        assert not cache.any()
