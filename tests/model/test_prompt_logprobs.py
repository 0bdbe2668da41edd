"""prompt_logprobs against transformers: on a tiny random model, every prompt position's
logprobs (the prompt token's value and rank, and the top k) equal log_softmax of transformers'
own float32 logits for the same weights, whether the prompt runs in one step or in chunks of a
few tokens, beside decoding streams, through preemptions, and after a prefix-cache hit (which
such a request does not read: it recomputes its whole prompt)."""

from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.worker import model_runner

from .test_families_engine import _save_tokenizer
from .tiny import hf_logits, save_tiny_checkpoint

ATOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf_model = save_tiny_checkpoint(folder, "llama", seed=11)
    _save_tokenizer(folder)
    return folder, hf_model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (12,), generator=gen).tolist()
    own = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (13, 5, 1)]
    return [shared + own[0], shared + own[1], own[2], own[0] + own[1]]


def _check(output, hf_model, prompt: list[int], k: int = K) -> None:
    """Every entry of output.prompt_logprobs against log_softmax of transformers' logits."""
    reference = hf_logits(hf_model, prompt).log_softmax(dim=-1)  # (len(prompt), vocab)
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for t in range(1, len(prompt)):
        row, token_id, entry = reference[t - 1], prompt[t], entries[t]
        # The prompt token's own entry comes first, with its rank in the whole vocabulary.
        assert next(iter(entry)) == token_id
        own = entry[token_id]
        assert own.logprob == pytest.approx(row[token_id].item(), abs=ATOL)
        assert own.rank == int((row > row[token_id] + ATOL).sum()) + 1
        top_values, top_ids = row.topk(k)
        for rank, (top_id, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            assert top_id in entry, (t, top_id, entry)
            assert entry[top_id].logprob == pytest.approx(value, abs=ATOL)
            if top_id != token_id:
                assert entry[top_id].rank == rank
        assert set(entry) == {token_id, *top_ids.tolist()}


def test_one_step_and_chunked_prefill_equal_transformers(checkpoint, monkeypatch):
    folder, hf_model = checkpoint
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    # Several log_softmax passes per chunk, as a chunk longer than the runner's row bound has.
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 4)
    for chunk_tokens in (64, 5):  # the longest prompt in one step, or in chunks of 5
        llm = LLM(
            str(folder),
            dtype="float32",
            block_size=4,
            kv_cache_tokens=256,
            max_num_batched_tokens=chunk_tokens,
            max_model_len=64,
            enable_prefix_caching=False,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for output, prompt in zip(outputs, prompts, strict=True):
            _check(output, hf_model, prompt)
            assert len(output.outputs[0].token_ids) == 3


def test_prompt_logprobs_is_a_count_or_minus_one():
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1
    for value in (-2, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be"):
            SamplingParams(prompt_logprobs=value)


def test_after_a_prefix_hit_through_preemption_and_beside_other_requests(checkpoint):
    """The request asking for prompt logprobs finds its prefix cached but recomputes it (its
    num_cached_tokens is 0); a request without them hits the cache. A pool too small for all
    of them preempts some: a request preempted before its first token gathers its prompt
    logprobs again from the start, one preempted after it recomputes its prompt without
    scoring it; either way they are reported once, whole."""
    folder, hf_model = checkpoint
    prompts = _prompts()
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_tokens=48,  # 12 blocks for eight requests of up to 41 tokens: preemption
        max_num_batched_tokens=8,
        max_model_len=48,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with_logprobs = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=K
    )
    llm.generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": prompts[1]}], plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 12  # the shared 12 tokens are cached
    again = llm.generate([{"prompt_token_ids": prompts[1]}], with_logprobs, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check(again, hf_model, prompts[1])

    prompts = prompts * 2
    mixed = [with_logprobs, plain, with_logprobs, with_logprobs] * 2
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed, use_tqdm=False)
    for output, prompt, params in zip(outputs, prompts, mixed, strict=True):
        if params is plain:
            assert output.prompt_logprobs is None
        else:
            _check(output, hf_model, prompt)
    assert outputs[2].prompt_logprobs == [None]  # a one-token prompt
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0
    scheduler.check_integrity()
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_zero_and_the_whole_vocabulary_and_the_bound(checkpoint):
    folder, hf_model = checkpoint
    prompt = _prompts()[1]
    llm = LLM(str(folder), dtype="float32", block_size=4, kv_cache_tokens=128, max_model_len=64)
    zero = SamplingParams(max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt}], zero, use_tqdm=False)[0]
    assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])
    _check(output, hf_model, prompt, k=0)
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate(prompt, SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=256 is more than max_logprobs=20"):
        llm.generate(prompt, SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    whole = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_tokens=128,
        max_model_len=64,
        max_logprobs=-1,
    )
    everything = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    output = whole.generate([{"prompt_token_ids": prompt}], everything, use_tqdm=False)[0]
    assert all(len(entry) == 256 for entry in output.prompt_logprobs[1:])
    _check(output, hf_model, prompt, k=256)
