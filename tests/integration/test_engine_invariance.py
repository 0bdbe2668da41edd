"""Greedy output of a prompt must not depend on how the engine happened to run it: alone, in a
batch, chunked, after a prefix-cache hit or after a preemption. Nothing may leak on the way."""

from __future__ import annotations

import pytest

from octavo import SamplingParams

from .utils import assert_greedy_agrees, assert_no_leak

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the nineteenth century were"
OTHERS = [
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The recipe for a simple tomato soup starts with",
    "Water boils at",
    "List five animals that live in the ocean:",
    "The meaning of the word 'serendipity' is",
    "In 1969, the first humans",
    "A good night's sleep is important because",
    "To make a paper airplane, first",
    "The capital of Japan is",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "The quick brown fox",
    "Here is a haiku about autumn:",
    "The difference between weather and climate is",
    "import numpy as np\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return _tokens(llm.generate([PROMPT], GREEDY, use_tqdm=False))[0]


def test_alone_and_in_a_batch_of_16(llm, reference) -> None:
    batch = llm.generate(OTHERS[:8] + [PROMPT] + OTHERS[8:], GREEDY, use_tqdm=False)
    assert _tokens(batch)[8] == reference
    assert all(len(tokens) == 32 for tokens in _tokens(batch))
    assert_no_leak(llm)


def test_chunked_prefill(make_llm, reference) -> None:
    # A budget of 8 tokens per step cuts every prompt into several chunks, and decodes share
    # the budget with chunks of other prompts.
    chunked = make_llm(max_num_batched_tokens=8, enable_prefix_caching=False)
    outputs = chunked.generate([PROMPT] + OTHERS[:3], GREEDY, use_tqdm=False)
    assert _tokens(outputs)[0] == reference
    assert_no_leak(chunked)


def test_default_cpu_blocks_of_128_tokens(make_llm, reference) -> None:
    # The CPU default block size: the same tokens, and a prompt longer than a block is cached
    # block by block (its one full block) for the next request.
    default = make_llm(block_size=None)
    assert default.llm_engine.config.cache.block_size == 128
    long_prompt = " ".join(OTHERS) * 2  # over 128 tokens
    first, again = (
        default.generate([long_prompt, PROMPT], GREEDY, use_tqdm=False) for _ in range(2)
    )
    assert _tokens(first)[1] == reference
    assert _tokens(again) == _tokens(first)
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == (len(first[0].prompt_token_ids) - 1) // 128 * 128 > 0
    assert_no_leak(default)


def test_after_a_prefix_cache_hit(llm) -> None:
    prompt = " ".join(OTHERS[:6])  # several full blocks
    assert llm.llm_engine.reset_prefix_cache()
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leak(llm)


def test_shared_64_token_prefix_is_cached(llm) -> None:
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(" ".join(["alpha beta gamma delta"] * 20))[:64]
    first = llm.generate([prefix + [1000, 1001, 1002]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prefix + [2000, 2001]], GREEDY, use_tqdm=False)[0]
    assert first.finished and second.finished
    assert second.num_cached_tokens >= 64
    assert_no_leak(llm)


@pytest.mark.parametrize("max_rows", [0, None], ids=["float-weights", "block-kernel"])
def test_preemption_keeps_greedy_output(make_llm, max_rows) -> None:
    """A preempted request is recomputed as a prefill of the tokens it had decoded; the
    prefill attention kernel sums those positions in another order than the decode kernel did
    (last-bit differences). With float weights (packed_max_rows=0) the output is the same token
    for token. The block kernel rounds activations to 8 bits, which turns such a difference
    into one of about the quantization's own size, so there a request may part at a near-tie
    (measured: one of 8, at token 43 of 48); every request still ends with all 48 tokens."""
    prompts = [PROMPT] + OTHERS[:7]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    roomy_outputs = make_llm(packed_max_rows=max_rows).generate(prompts, params, use_tqdm=False)
    roomy = _tokens(roomy_outputs)
    # 8 requests of ~15 + 48 tokens need ~32 blocks of 16; the pool has 12.
    tight = make_llm(kv_cache_tokens=192, max_model_len=192, packed_max_rows=max_rows)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.make_stats().num_preemptions > 0
    if max_rows == 0:
        assert _tokens(outputs) == roomy
    else:
        assert all(len(tokens) == 48 for tokens in _tokens(outputs))
        assert_greedy_agrees(roomy_outputs, outputs)
    assert_no_leak(tight)


def test_seeded_sampling_is_batch_invariant(llm) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].text
    others = SamplingParams(temperature=1.0, max_tokens=24)
    params = [others] * 5 + [seeded] + [others] * 5
    batch = llm.generate(OTHERS[:5] + [PROMPT] + OTHERS[5:10], params, use_tqdm=False)
    assert batch[5].outputs[0].text == alone
    assert_no_leak(llm)
