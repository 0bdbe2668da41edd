"""The CPU kernels (model/cpu/ops.py) against their plain-torch references (reference.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.model.backends import torch_ops
from octavo.model.cpu import build, ops, packing, reference
from octavo.sample.ops.topk_topp import invert_cdf

pytestmark = pytest.mark.skipif(not build.load(), reason="CPU kernels not built")


def _paged_inputs(num_seqs, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = num_seqs * max_blocks + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Blocks shuffled so that no request's blocks are contiguous or in order; padding entries
    # point at real blocks, which the kernel must not read past seq_len.
    order = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    block_table = order.view(num_seqs, max_blocks).to(torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key_cache.to(dtype), value_cache.to(dtype), block_table, lens


# Head sizes of 64 and 128 take the AVX-512 path where there is one: groups of 1, 3 and 7
# query heads (7 = 4 + 3 in its value pass, 3 at 128 = 2 + 1), blocks of 8, 16 and 32 tokens
# (scores go sixteen keys at a time). Others take the AVX2 or generic loops.
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),
        (4, 4, 16, 4),
        (8, 2, 128, 16),
        (2, 1, 20, 3),
        (28, 4, 64, 32),
        (12, 4, 128, 8),
        (8, 8, 64, 16),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("few", [False, True], ids=["many-seqs", "one-seq"])
def test_paged_decode_attention_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, dtype, few
):
    # One sequence is split by kv head between threads; many are split by sequence.
    seq_lens = [37] if few else [1, block_size, block_size + 1, 37, 5 * block_size - 1]
    inputs = _paged_inputs(
        len(seq_lens),
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=num_heads + head_dim,
    )
    out = ops.paged_decode_attention(*inputs, scale=head_dim**-0.5)
    expected = reference.paged_decode_attention_reference(*inputs, scale=head_dim**-0.5)
    assert out.shape == (len(seq_lens), num_heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_decode_attention_of_one_key_is_its_value():
    query, key_cache, value_cache, block_table, _ = _paged_inputs(
        2, [1, 1], 6, 2, 8, 4, torch.float32, seed=0
    )
    out = ops.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        torch.tensor([1, 1], dtype=torch.int32),
        scale=1.0,
    )
    for i in range(2):
        first = value_cache[block_table[i, 0].long(), 0]  # (kv_heads, head_dim)
        torch.testing.assert_close(out[i], first.repeat_interleave(3, dim=0))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 2, 16, 4), (2, 1, 20, 3)]
)
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (5, 0.0), (40, 0.0), (0, 2.5), (16, 2.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_with_a_window_and_softcap_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, window, softcap, dtype
):
    """A sliding window (keys outside it masked, whole blocks before it included) and
    Gemma 2's soft-capping, on the AVX-512, AVX2 and generic loops alike."""
    seq_lens = [1, block_size, block_size + 1, 37, 5 * block_size - 1]
    inputs = _paged_inputs(
        len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3
    )
    # Large scores, so that the cap bends them (tanh is far from linear at 2.5).
    out = ops.paged_decode_attention(*inputs, 0.5, window, softcap)
    expected = reference.paged_decode_attention_reference(*inputs, 0.5, window, softcap)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    if window and not softcap:
        full = ops.paged_decode_attention(*inputs, 0.5)
        long_rows = [i for i, n in enumerate(seq_lens) if n > window]
        short_rows = [i for i, n in enumerate(seq_lens) if n <= window]
        assert torch.equal(out[short_rows], full[short_rows])
        if long_rows:
            assert not torch.allclose(out[long_rows], full[long_rows])


def test_a_window_equals_attending_to_the_last_keys_alone():
    """Independent of the reference: a query under a window of W sees what it sees when its
    sequence is only the last W keys (here block-aligned: a table that starts later)."""
    query, key_cache, value_cache, block_table, _ = _paged_inputs(
        1, [40], 8, 2, 64, 8, torch.float32, seed=5
    )
    lens = torch.tensor([40], dtype=torch.int32)
    windowed = ops.paged_decode_attention(query, key_cache, value_cache, block_table, lens, 0.1, 16)
    last = ops.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_table[:, 3:].contiguous(),
        torch.tensor([16], dtype=torch.int32),
        0.1,
    )
    torch.testing.assert_close(windowed, last, atol=1e-6, rtol=1e-6)


def _prefill_inputs(chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """chunks: (query_len, seq_len) each. Their rows sit in a flat batch after one unrelated row
    and with one between each pair (as decodes would), keys in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-seq_len // block_size) for _, seq_len in chunks)
    num_blocks = len(chunks) * max_blocks + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)[: len(chunks) * max_blocks]
    block_table = order.view(len(chunks), max_blocks).to(torch.int32)
    starts, row = [], 1
    for q_len, _ in chunks:
        starts.append(row)
        row += q_len + 1
    query = torch.randn(row, num_heads, head_dim, generator=gen)
    ints = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    lens = ints([q for q, _ in chunks]), ints([s for _, s in chunks])
    return query, key_cache, value_cache, block_table, ints(starts), *lens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 16), (10, 2, 40, 5), (2, 1, 20, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, dtype
):
    # Whole prompts (one longer than a query tile, one longer than a key step of 256), chunks
    # after a cached prefix (starting mid-block, one crossing a key step), and a one-token chunk.
    chunks = [(100, 100), (37, 140), (1, 9), (5, 5), (70, 77), (300, 300), (20, 530)]
    query, *args = _prefill_inputs(
        chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=num_heads + head_dim
    )
    out = torch.full_like(query, 7.0)
    expected = torch.full_like(query, 7.0)
    ops.paged_prefill_attention(out, query, *args, scale=head_dim**-0.5)
    reference.paged_prefill_attention_reference(expected, query, *args, scale=head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # Rows between the chunks are not touched.
    assert bool((out[[0, 101, 139, 141, 147, 218, 519]] == 7.0).all())


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (2, 1, 20, 3)]
)
@pytest.mark.parametrize(
    "window,softcap", [(1, 0.0), (7, 0.0), (64, 0.0), (300, 0.0), (0, 2.5), (50, 2.5)]
)
def test_paged_prefill_attention_with_a_window_and_softcap_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, window, softcap
):
    """Windows smaller than a query tile, than a key step (256) and larger than one, over
    whole prompts and chunks after a cached prefix; soft-capped scores."""
    chunks = [(100, 100), (37, 140), (1, 9), (5, 5), (70, 77), (300, 300), (20, 530)]
    query, *args = _prefill_inputs(
        chunks, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=11
    )
    out = torch.full_like(query, 7.0)
    expected = torch.full_like(query, 7.0)
    ops.paged_prefill_attention(out, query, *args, 0.5, window, softcap)
    reference.paged_prefill_attention_reference(expected, query, *args, 0.5, window, softcap)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


bf16_products = pytest.mark.skipif(
    not (build.load() and ops.bf16_tiles_available()),
    reason="no bfloat16 dot products here: the CPU lacks avx512_bf16 (or there are no kernels)",
)


@bf16_products
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),
        (4, 4, 16, 4),
        (8, 2, 128, 128),
        (10, 2, 40, 5),
        (2, 1, 20, 3),
        (6, 2, 64, 24),
    ],
)
@pytest.mark.parametrize(
    "scale,window,softcap", [(0.125, 0, 0.0), (0.5, 7, 0.0), (0.25, 300, 0.0), (0.5, 50, 2.5)]
)
@pytest.mark.parametrize("amx", [True, False])
def test_paged_prefill_attention_in_bf16_is_the_reference_with_bf16_operands(
    num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, amx
):
    """The bfloat16 products (AMX tiles where the CPU has them and `amx`, else AVX512-BF16 dot
    products) round the scaled queries and the softmax weights to bfloat16. Against the
    reference given the same rounded queries (scales are powers of two, so q * scale rounds
    back exactly), what is left is the weights' rounding: at most 2^-9 of each weight, so
    within 2^-8 of the largest value's magnitude (float32 sums otherwise). Head sizes that are
    not a multiple of 32 (padded dimensions), chunks as the float kernel's test, windows and a
    soft-cap; rows between the chunks untouched."""
    chunks = [(100, 100), (37, 140), (1, 9), (5, 5), (70, 77), (300, 300), (20, 530)]
    query, *args = _prefill_inputs(
        chunks, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=head_dim
    )
    out = torch.full_like(query, 7.0)
    ops.paged_prefill_attention(out, query, *args, scale, window, softcap, tiles=True, amx=amx)
    rounded = (query * scale).bfloat16().float() / scale
    expected = torch.full_like(query, 7.0)
    reference.paged_prefill_attention_reference(expected, rounded, *args, scale, window, softcap)
    bound = 2**-8 * args[1].float().abs().max().item()
    torch.testing.assert_close(out, expected, atol=bound, rtol=0)
    assert bool((out[[0, 101, 139, 141, 147, 218, 519]] == 7.0).all())
    # The float path on the same cache differs by the queries' and weights' rounding only.
    floats = torch.full_like(query, 7.0)
    ops.paged_prefill_attention(floats, query, *args, scale, window, softcap)
    assert (out - floats).abs().max().item() < 0.05
    assert not torch.equal(out, floats)  # the bfloat16 products did run


@bf16_products
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 2, 128, 16), (28, 4, 64, 32), (12, 4, 128, 8), (8, 8, 64, 5)],
)
@pytest.mark.parametrize("scale,window,softcap", [(0.125, 0, 0.0), (0.5, 7, 0.0), (0.5, 0, 2.5)])
@pytest.mark.parametrize("few", [False, True], ids=["many-seqs", "one-seq"])
def test_paged_decode_attention_in_bf16_is_the_reference_with_bf16_operands(
    num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, few
):
    """bf16_products rounds the scaled queries and the softmax weights to bfloat16 (as the
    prompt kernel's bfloat16 products do). Against the reference given the same rounded
    queries (power-of-two scales: q * scale rounds back exactly), what is left is the weights'
    rounding, within 2^-8 of the largest value's magnitude. Odd and even block lengths (value
    rows go two at a time), one sequence split by kv head and many by sequence."""
    seq_lens = [37] if few else [1, 2, block_size, block_size + 1, 37, 5 * block_size - 1]
    heads = (num_heads, num_kv_heads, head_dim)
    query, *args = _paged_inputs(len(seq_lens), seq_lens, *heads, block_size, torch.bfloat16, 7)
    out = ops.paged_decode_attention(query, *args, scale, window, softcap, bf16_products=True)
    rounded = (query * scale).bfloat16().float() / scale
    expected = reference.paged_decode_attention_reference(rounded, *args, scale, window, softcap)
    bound = 2**-8 * args[1].float().abs().max().item()
    torch.testing.assert_close(out, expected, atol=bound, rtol=0)
    # The float path on the same cache differs by the queries' and weights' rounding only.
    floats = ops.paged_decode_attention(query, *args, scale, window, softcap)
    assert (out - floats).abs().max().item() < 0.05
    assert not torch.equal(out, floats)  # the bfloat16 products did run


def test_paged_decode_attention_refuses_bf16_products_over_a_float32_cache():
    inputs = _paged_inputs(2, [5, 9], 4, 2, 64, 4, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="bf16_products needs a bfloat16 cache"):
        ops.paged_decode_attention(*inputs, 0.3, bf16_products=True)


# Head sizes 64 (the AVX-512 loops, and bfloat16 products where the CPU has them), 24 (AVX2)
# and 20 (the generic loops).
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,bf16_products",
    [(9, 3, 64, False), (9, 3, 64, True), (4, 2, 24, False), (2, 1, 20, False)],
)
def test_paged_decode_attention_reads_a_query_view_in_place(
    num_heads, num_kv_heads, head_dim, bf16_products
):
    """The fused decode layer hands attention its rotated query where it lies, a view into the
    wider q/k/v projection (heads contiguous, rows qkv's width apart): the same results as
    the contiguous copy, bit for bit, with the kernel given the view itself."""
    if bf16_products and not ops.bf16_tiles_available():
        pytest.skip("the CPU has no avx512_bf16")
    seq_lens = [1, 16, 17, 37, 79]
    n, q_size = len(seq_lens), num_heads * head_dim
    heads = (num_heads, num_kv_heads, head_dim)
    query, *args = _paged_inputs(n, seq_lens, *heads, 16, torch.bfloat16, 5)
    qkv = torch.randn(n, q_size + 2 * num_kv_heads * head_dim)
    qkv[:, :q_size] = query.reshape(n, -1)
    view = qkv[:, :q_size].view(n, num_heads, head_dim)
    assert not view.is_contiguous() and ops.heads_contiguous(view)
    out = torch.ops.octavo.paged_decode_attention(view, *args, 0.125, 0, 0.0, bf16_products)
    expected = ops.paged_decode_attention(query, *args, 0.125, bf16_products=bf16_products)
    assert out.is_contiguous() and torch.equal(out, expected)


def test_paged_prefill_attention_reads_a_query_view_in_place():
    # The query as the model hands it over: a view into the wider q/k/v projection, its heads
    # contiguous within a token but tokens further apart.
    chunks = [(40, 40), (3, 20), (33, 70)]
    query, *args = _prefill_inputs(chunks, 6, 2, 32, 16, torch.float32, seed=5)
    wide = torch.randn(query.shape[0], 6 + 4, 32)
    wide[:, 2:8] = query
    view = wide[:, 2:8]
    assert not view.is_contiguous() and ops.heads_contiguous(view)
    out, expected = torch.zeros_like(query), torch.zeros_like(query)
    ops.paged_prefill_attention(out, view, *args, scale=0.2)
    ops.paged_prefill_attention(expected, query, *args, scale=0.2)
    assert torch.equal(out, expected)


def test_paged_prefill_attention_first_query_sees_only_the_first_key():
    query, key_cache, value_cache, block_table, *rest = _prefill_inputs(
        [(6, 6)], 4, 2, 8, 4, torch.float32, seed=1
    )
    out = torch.zeros_like(query)
    ops.paged_prefill_attention(out, query, key_cache, value_cache, block_table, *rest, scale=1.0)
    first = value_cache[block_table[0, 0].long(), 0]  # (kv_heads, head_dim)
    torch.testing.assert_close(out[1], first.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 12, 13, 25, 64, 115])
@pytest.mark.parametrize("n,k", [(7, 16), (64, 576), (33, 19), (130, 1536), (16, 1)])
@pytest.mark.parametrize("exact_bf16", [False, True])
def test_packed_linear_matches_reference(rows, n, k, exact_bf16):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    if exact_bf16:
        weight = weight.bfloat16().float()
    packed = packing.pack_linear_weight(weight)
    assert packed.dtype == (torch.bfloat16 if exact_bf16 else torch.float32)
    width = build.panel_width()
    assert packed.shape == (-(-n // width), k, width)
    # Packing loses nothing: the packed copy unpacks to the weight, bit for bit.
    assert torch.equal(packing.unpack_linear_weight(packed, n).float(), weight)
    out = ops.packed_linear(x, packed, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    expected = F.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(
        reference.packed_linear_reference(x, packed, n), expected, atol=1e-4, rtol=1e-5
    )


def test_packed_linear_reads_strided_rows_and_large_batches():
    # More rows than one chunk of x (the kernel splits rows into chunks that fit in cache).
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 2048, generator=gen)
    x = torch.randn(200, 2048, generator=gen)
    out = ops.packed_linear(x, packing.pack_linear_weight(weight), 40)
    torch.testing.assert_close(
        out, F.linear(x.double(), weight.double()).float(), atol=1e-3, rtol=1e-5
    )


def test_rms_norm_matches_torch_with_and_without_the_residual_add():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, generator=gen)
    x, residual = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen)
    alone = x.clone()
    ops.rms_norm_(alone, weight, 1e-5)
    torch.testing.assert_close(alone, torch_ops.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    normed, summed = x.clone(), residual.clone()
    ops.rms_norm_(normed, weight, 1e-5, summed)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(
        normed, torch_ops.rms_norm(x + residual, weight, 1e-5), atol=1e-6, rtol=1e-5
    )


def test_rotary_matches_torch_on_a_packed_view():
    from octavo.model.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(2)
    cos, sin = RotaryEmbedding(16, 10000.0, None)(torch.tensor([0, 5, 17, 300]), torch.float32)
    packed = torch.randn(4, 3 * 16 + 2 * 16, generator=gen)  # q: 3 heads, k and v: 1 head
    q = packed[:, :48].view(4, 3, 16)
    expected = apply_rotary(q, cos, sin)
    untouched = packed[:, 48:].clone()
    ops.rotary_(q, cos, sin)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-5)  # rotated where it lies
    assert torch.equal(packed[:, 48:], untouched)  # k and v columns left alone


def test_silu_and_mul_matches_torch():
    gen = torch.Generator().manual_seed(3)
    # 61 = 3 x 16 + 8 + 5: 16-lane vectors (AVX-512), an 8-lane one (AVX2) and a scalar tail
    gate_up = 6 * torch.randn(7, 2 * 61, generator=gen)
    gate_up[0, :8] = torch.tensor([-100.0, -88.5, -50.0, 0.0, 50.0, 88.5, 100.0, 1e30])
    gate_up[1, 50:58] = gate_up[0, :8]  # the same values in the 8-lane part
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (7, 61)
    torch.testing.assert_close(out, reference.silu_and_mul_reference(gate_up), atol=1e-6, rtol=1e-5)


def test_silu_and_mul_of_bf16_rounds_the_float32_result_once():
    """A bfloat16 gate_up gives what the float32 kernel gives on the same (exact) values,
    rounded once to bfloat16 as torch rounds: bit for bit, so a feed-forward may keep its
    activations in bfloat16 between two bf16 GEMMs (layers/mlp.py)."""
    gen = torch.Generator().manual_seed(4)
    gate_up = (6 * torch.randn(9, 2 * 61, generator=gen)).bfloat16()
    out = ops.silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 61)
    assert torch.equal(out, ops.silu_and_mul(gate_up.float()).bfloat16())


def test_argmax_rows_is_torchs_argmax():
    """Rows of 1 to 3,000 values (the vector lanes and their tails), ties (torch takes the first
    of equals, whichever lane or tail holds it), rows of -inf only, NaNs (torch takes the first
    NaN: in the vector part, in the tail, two of them), -0.0 beside 0.0, and logits that are
    not contiguous float32."""
    gen = torch.Generator().manual_seed(6)
    for trial in range(80):
        rows, vocab = 9, int(torch.randint(1, 3000, (1,), generator=gen))
        # Few distinct values, so that the largest repeats across lanes and the tail.
        logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
        logits[1] = float("-inf")
        logits[2, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")
        logits[3, -1] = float("nan")
        logits[4, vocab // 2 :] = float("nan")
        logits[5] = 0.0
        logits[5, vocab // 3] = -0.0
        logits[6] = torch.randn(vocab, generator=gen)
        logits[7, -1] = 1e30  # the largest in the last place (often the scalar tail)
        got = ops.argmax_rows(logits)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, logits.argmax(dim=1)), (trial, vocab)
    wide = torch.randn(3, 2 * 1000, generator=gen)
    assert torch.equal(ops.argmax_rows(wide[:, ::2]), wide[:, ::2].argmax(dim=1))
    assert torch.equal(ops.argmax_rows(wide.double()), wide.argmax(dim=1))


def test_sample_categorical_matches_the_torch_draw():
    """Logits where half the tokens were dropped by a filter (-inf), rows of 1 to 3,000 tokens
    (eight-token runs and tails), uniforms that include 0 and the largest float below 1: the
    kernel picks the token torch's softmax + cumsum + search picks (up to rounding at the very
    end of the mass), and never a dropped one."""
    gen = torch.Generator().manual_seed(5)
    mismatches = 0
    for trial in range(60):
        rows, vocab = 8, int(torch.randint(1, 3000, (1,), generator=gen))
        spread = float(1 + 9 * torch.rand(1, generator=gen))
        logits = torch.randn(rows, vocab, generator=gen) * spread
        dropped = torch.rand(rows, vocab, generator=gen) < 0.5
        keep = torch.randint(0, vocab, (rows,), generator=gen)
        dropped[torch.arange(rows), keep] = False
        logits[dropped] = float("-inf")
        uniform = torch.rand(rows, 1, generator=gen)
        uniform[0], uniform[1] = 0.0, 1.0 - 2**-24
        expected = invert_cdf(logits.softmax(dim=1).cumsum(dim=1), uniform)
        got = ops.sample_categorical(logits.clone(), uniform)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert not dropped[torch.arange(rows), got].any(), trial
        # u just below 1 lands within rounding of the total: the pick must reach the end of
        # the mass (any token whose cumulative mass is within rounding of 1 is right, and the
        # two sum in different orders).
        assert logits[1].softmax(0).cumsum(0)[got[1]].item() > 1 - 1e-5
        # Elsewhere a rounding difference could move a draw on a boundary to the next token.
        mismatches += int((got[[0, *range(2, rows)]] != expected[[0, *range(2, rows)]]).sum())
    assert mismatches <= 2


def test_sample_categorical_takes_a_non_contiguous_row_set_and_overwrites_logits():
    logits = torch.full((4, 20), float("-inf"))
    logits[:, 7] = 1.0
    logits[:, 12] = 1.0
    got = ops.sample_categorical(logits[::2], torch.tensor([[0.25], [0.75]]))
    assert got.tolist() == [7, 12]
    contiguous = logits.clone()
    ops.sample_categorical(contiguous, torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert contiguous[0, 7].item() == 1.0 and contiguous[0, 0].item() == 0.0  # exp(l - max)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_matches_index_copy(cache_dtype):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, (4 + 2 + 2) * 8, generator=gen)  # 4 q heads, 2 kv heads, head_dim 8
    key, value = qkv[:, 32:48].view(5, 2, 8), qkv[:, 48:].view(5, 2, 8)  # strided views
    slots = torch.tensor([9, 0, 23, 4, 17])
    cache = torch.randn(2, 6, 4, 2, 8, generator=gen).to(cache_dtype)
    expected = cache.clone()
    expected[0].view(-1, 2, 8).index_copy_(0, slots, key.to(cache_dtype))
    expected[1].view(-1, 2, 8).index_copy_(0, slots, value.to(cache_dtype))
    assert ops.heads_contiguous(key) and ops.heads_contiguous(value)
    ops.write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)  # bf16: rounded to nearest even, as torch converts
    with pytest.raises(RuntimeError, match="slot 24 is outside the cache's 24 slots"):
        ops.write_kv_cache(key, value, cache, torch.tensor([0, 1, 2, 3, 24]))


def test_kernels_return_the_input_dtype():
    query, key_cache, value_cache, block_table, lens = _paged_inputs(
        2, [5, 9], 4, 2, 8, 4, torch.float32, seed=2
    )
    out = ops.paged_decode_attention(
        query.bfloat16(), key_cache, value_cache, block_table, lens, scale=0.3
    )
    assert out.dtype == torch.bfloat16
    expected = reference.paged_decode_attention_reference(
        query.bfloat16().float(), key_cache, value_cache, block_table, lens, 0.3
    )
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_float32_panels_on_request_and_the_bench_runs(capsys):
    import json
    import subprocess
    import sys

    weight = torch.randn(20, 12).bfloat16().float()
    packed = packing.pack_linear_weight(weight, allow_bf16=False)
    assert packed.dtype == torch.float32
    assert torch.equal(packing.unpack_linear_weight(packed, 20), weight)
    x = torch.randn(3, 12)
    torch.testing.assert_close(
        ops.packed_linear(x, packed, 20),
        ops.packed_linear(x, packing.pack_linear_weight(weight), 20),
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "octavo.model.cpu",
            "--bench",
            "--hidden-size",
            "32",
            "--intermediate-size",
            "48",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--layers",
            "2",
            "--rows",
            "1,7",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # 2 layers x (qkv 64x32 + o 32x32 + gate/up 96x32 + down 32x48)
    assert result["num_params"] == 2 * (64 * 32 + 32 * 32 + 96 * 32 + 32 * 48)
    assert [row["rows"] for row in result["results"]] == [1, 7]
    for row in result["results"]:
        assert min(row["torch_fp32_ms"], row["packed_bf16_ms"], row["packed_fp32_ms"]) > 0


def test_attention_bench_runs_for_each_batch_and_cache_dtype():
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "octavo.model.cpu",
            "--bench",
            "--attention",
            "--hidden-size",
            "64",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--layers",
            "2",
            "--seqs",
            "1,3",
            "--context-len",
            "37",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["context_len"] == 37
    rows = [(row["seqs"], row["kv_dtype"]) for row in result["results"]]
    assert rows == [(1, "float32"), (1, "bfloat16"), (3, "float32"), (3, "bfloat16")]
    for row in result["results"]:
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0
        # The bfloat16 products are timed beside the float kernel where the CPU has them.
        products = row["kv_dtype"] == "bfloat16" and ops.bf16_tiles_available()
        assert ("bf16_products_ms" in row) == products
        assert not products or row["bf16_products_ms"] > 0


@pytest.mark.parametrize("prefix_len", [0, 21])
def test_prefill_bench_runs_for_each_prompt_length(prefix_len):
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "octavo.model.cpu",
            "--bench",
            "--prefill",
            "--hidden-size",
            "64",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--layers",
            "2",
            "--prompt-lens",
            "5,40",
            "--prefix-len",
            str(prefix_len),
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(row["prompt_len"], row["prefix_len"]) for row in result["results"]] == [
        (5, prefix_len),
        (40, prefix_len),
    ]
    for row in result["results"]:
        assert row["kernel_ms"] > 0 and row["sdpa_ms"] > 0
