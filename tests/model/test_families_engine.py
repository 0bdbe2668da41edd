"""The new families through the whole engine: greedy tokens equal transformers' `generate`.

Each tiny random model (transformers' own config class, saved by the test, with a word-level
tokenizer over its 256 ids) runs in octavo's LLM with blocks of 4 tokens, chunked prefill
(16-token budget), prefix caching and a KV pool small enough that the batch preempts; prompts
are 3-5 times the sliding windows, several sharing a prefix, so chunks and decodes cross the
window's edge, resumed requests recompute through it and prefix hits start inside it. Every
request's tokens must be exactly transformers' greedy continuation of its prompt alone.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from octavo import LLM, SamplingParams
from octavo.core.kv_cache_manager import NULL_BLOCK, sliding_window_blocks

from .tiny import save_tiny_checkpoint

FAMILIES = {
    "mistral": ("mistral", {"sliding_window": 6, "head_dim": 16}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "olmo2": ("olmo2", {}),
    # LongRoPE with short factors throughout: transformers' generate, once a sequence outgrows
    # original_max_position_embeddings, drops its cache and recomputes every position with the
    # long factors, which octavo does not (it rotates each position by its own set).
    "phi3": (
        "phi3",
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "sliding_window": 9,
            "original_max_position_embeddings": 64,
            "max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
}
NUM_TOKENS = 12


def _save_tokenizer(folder) -> None:
    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(folder)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 256, (9,), generator=gen).tolist()
    own = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (11, 6, 14, 3)]
    return [shared + own[0], shared + own[1], own[2], shared + own[3], own[0] + own[2]]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_through_preemption_chunks_and_prefix_hits(
    tmp_path, family
):
    model_type, overrides = FAMILIES[family]
    hf_model = save_tiny_checkpoint(tmp_path, model_type, seed=21, **overrides)
    hf_model.generation_config.eos_token_id = None  # run every request to NUM_TOKENS
    _save_tokenizer(tmp_path)
    prompts = _prompts()
    expected = [_hf_greedy(hf_model, prompt) for prompt in prompts]

    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        kv_cache_tokens=48,  # 12 blocks for five requests of up to 35 tokens: preemption
        max_num_batched_tokens=16,
        max_model_len=48,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    # The sliding-window families run with the hybrid KV cache manager: one group for a
    # window on every layer, a full and a sliding group (one layer each) for Gemma's mix.
    windows = {"mistral": (6,), "phi3": (9,), "gemma2": (0, 5), "gemma3": (0, 4)}
    assert llm.llm_engine.config.cache.group_windows == windows.get(family, (0,))
    stats = llm.llm_engine.scheduler.kv_cache_manager
    assert stats.prefix_cache_hits > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0
    stats.check_integrity()
    assert stats.num_free_blocks == stats.num_blocks


def test_under_a_window_a_request_outgrows_the_pool_and_holds_only_its_window(tmp_path):
    """Mistral with a window of 6 on every layer, blocks of 4, a pool of 12 blocks (48
    tokens): the hybrid KV cache manager gives back the blocks the window has left, so one
    request runs to 90 tokens (max_model_len 96 is accepted beyond the pool) holding at most
    ceil(6 / 4) + 1 blocks for each 1-token step (4 with the 16-token prompt chunk), with
    transformers' tokens; --disable-hybrid-kv-cache-manager keeps every block, and then
    max_model_len must fit the pool."""
    model_type, overrides = FAMILIES["mistral"]
    hf_model = save_tiny_checkpoint(tmp_path, model_type, seed=21, **overrides)
    hf_model.generation_config.eos_token_id = None
    _save_tokenizer(tmp_path)
    prompt = _prompts()[0]  # 20 tokens
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=70, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    args = dict(
        dtype="float32",
        block_size=4,
        kv_cache_tokens=48,
        max_num_batched_tokens=16,
        max_model_len=96,
    )
    llm = LLM(str(tmp_path), **args)
    engine = llm.llm_engine
    assert engine.config.cache.sliding_window == 6
    kv = engine.scheduler.kv_cache_manager
    engine.add_request(
        "r",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True),
    )
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if "r" in kv.req_to_blocks:
            held.append(kv.num_held_blocks("r"))
    assert tokens == expected
    assert max(held) <= sliding_window_blocks(6, 4, 16) and held[-1] <= 3
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(str(tmp_path), disable_hybrid_kv_cache_manager=True, **args)


def test_gemma_keeps_its_full_layers_blocks_and_only_the_window_of_its_sliding_ones(tmp_path):
    """Gemma 2 (a sliding layer with a window of 5, a full one): two KV cache groups sharing one
    layer's worth of cache per block. While one request decodes to 90 tokens the full group
    holds every block of its context and the sliding group at most the window's and a chunk's
    (ceil((5 - 1 + 16) / 4) + 1 = 6), with transformers' tokens; with the manager off each
    block holds both layers and the request holds all of them."""
    model_type, overrides = FAMILIES["gemma2"]
    hf_model = save_tiny_checkpoint(tmp_path, model_type, seed=21, **overrides)
    hf_model.generation_config.eos_token_id = None
    _save_tokenizer(tmp_path)
    prompt = _prompts()[0]
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=70, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        kv_cache_tokens=96,
        max_num_batched_tokens=16,
        max_model_len=96,
    )
    engine = llm.llm_engine
    cache = engine.config.cache
    assert cache.group_windows == (0, 5) and cache.layer_groups == ((1, 0), (0, 0))
    assert cache.num_blocks == 48  # 96 tokens of both layers = 48 blocks of one layer's
    kv = engine.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    tokens, full_held, sliding_held = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if "r" in kv.req_to_blocks:
            full, sliding = kv.req_to_blocks["r"], kv.groups[1].req_to_blocks["r"]
            full_held.append(len(full))
            sliding_held.append(sum(1 for block in sliding if block is not NULL_BLOCK))
    assert tokens == expected
    assert full_held[-1] == 88 // 4  # positions 0..87: the step before the last
    assert max(sliding_held) <= sliding_window_blocks(5, 4, 16) and sliding_held[-1] <= 3
    assert kv.num_free_blocks == kv.num_blocks
