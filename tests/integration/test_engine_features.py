"""Engine features that depend on the real model: temperature reaching the sampler, the
model's EOS ids, multibyte text, logprobs, the CPU chunk default, 16-bit caches. The engine's
own logic (aborts, n > 1, seeds, stops, limits, errors) is tested on the mock model in
tests/engine/test_engine_behaviour.py."""

from __future__ import annotations

import math

import pytest
import torch

from octavo import SamplingParams
from octavo.engine.output_processor import OutputKind

from .utils import assert_greedy_agrees, assert_no_leak

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_a_small_temperature_samples_the_greedy_answer(llm) -> None:
    """Temperature reaches the sampler (it skips the division only when every temperature is 0
    or 1): at 0.001 a lead of 0.01 nats becomes 10, so seeded rows sample the greedy answer of
    the row beside them, where temperature 1 would not."""
    prompt = "Write a short poem about the sea."
    cold = [
        SamplingParams(temperature=0.001, seed=seed, max_tokens=16, ignore_eos=True)
        for seed in range(3)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        *cold,
        SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True),
    ]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    greedy, warm = outputs[0].outputs[0].token_ids, outputs[-1].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == greedy for o in outputs[1:-1])
    assert warm != greedy  # the same seed at temperature 1: the check above can fail
    assert_no_leak(llm)


def test_eos_min_tokens_and_ignore_eos(llm) -> None:
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
    done = short.outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason is None  # EOS
    n = len(done.token_ids)
    eos_ids = llm.llm_engine.input_processor.eos_token_ids
    assert done.token_ids[-1] in eos_ids
    longer = llm.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=200, min_tokens=n + 5), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert not set(longer.token_ids[: n + 5]) & set(eos_ids)
    ignored = llm.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=n + 10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignored.token_ids) == n + 10 and ignored.finish_reason == "length"
    assert_no_leak(llm)


def test_multibyte_text_is_never_broken(llm) -> None:
    prompt = "Translate to Japanese and add emoji: I love the sea. 🌊 海が"
    outputs = llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=48), use_tqdm=False
    )
    completion = outputs[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in completion.text or "\ufffd" in tokenizer.decode(completion.token_ids)


def test_logprobs(llm) -> None:
    out = llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert token_id in position and len(position) in (3, 4)
        assert position[token_id].rank == 1  # greedy picks the top token
        best = max(position.values(), key=lambda lp: lp.logprob)
        assert best is position[token_id]
        total += position[token_id].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_prompts_run_in_256_token_chunks_beside_decoding_streams_on_a_cpu_unless_set(
    make_llm, llm, monkeypatch
) -> None:
    """The CPU default caps each prompt's chunk in a step that carries decoding streams (a
    long prompt must not freeze them); a step without them takes the prompt whole within the
    token budget. An explicit value, 0 included, is kept."""
    assert llm.llm_engine.config.device == "cpu"
    assert llm.llm_engine.config.scheduler.long_prefill_token_threshold == 256
    uncapped = make_llm(long_prefill_token_threshold=0)
    assert uncapped.llm_engine.config.scheduler.long_prefill_token_threshold == 0
    engine = llm.llm_engine
    schedule, chunks = engine.scheduler.schedule, []

    def recording_schedule():
        output = schedule()
        chunks.append(output.num_scheduled_tokens.get("long"))
        return output

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    # Alone: 450 tokens in one step, then the second token.
    engine.add_request("long", list(range(100, 550)), greedy, OutputKind.FINAL_ONLY)
    while engine.has_unfinished_requests():
        engine.step()
    assert chunks == [450, 1]
    # Beside a decoding stream: chunks of 256 and 194 (another prompt: no cached prefix).
    streaming = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("stream", [5, 6, 7], streaming, OutputKind.FINAL_ONLY)
    engine.step()
    chunks.clear()
    engine.add_request("long", list(range(600, 1050)), greedy, OutputKind.FINAL_ONLY)
    while engine.has_unfinished_requests():
        engine.step()
    assert [c for c in chunks if c is not None] == [256, 194, 1]
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16_bit_kv_cache_holds_twice_the_tokens_and_decodes(make_llm, llm, kv_cache_dtype):
    """float32 compute over a 16-bit cache: half the bytes per token, so the same memory holds
    twice the tokens; bf16 decodes through the paged kernel, float16 (which the kernel does not
    read) through gathered blocks. Greedy text stays that of the float32 cache, except where
    it parts at a near-tie (the block kernel rounds activations to 8 bits, so a cache's
    rounding can move one)."""
    memory = 64 * llm.llm_engine.config.cache.bytes_per_token * 16
    wide = make_llm(kv_cache_tokens=None, kv_cache_memory_bytes=memory)
    narrow = make_llm(
        kv_cache_tokens=None, kv_cache_memory_bytes=memory, kv_cache_dtype=kv_cache_dtype
    )
    assert narrow.llm_engine.config.cache.dtype == kv_cache_dtype
    assert wide.llm_engine.config.cache.dtype == "float32"
    assert 2 * narrow.llm_engine.config.cache.bytes_per_token == (
        wide.llm_engine.config.cache.bytes_per_token
    )
    assert narrow.llm_engine.config.cache.num_blocks == 2 * wide.llm_engine.config.cache.num_blocks
    assert narrow.llm_engine.model_runner.kv_caches[0].dtype == getattr(torch, kv_cache_dtype)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    expected = wide.generate(prompts, greedy, use_tqdm=False)
    assert_greedy_agrees(expected, narrow.generate(prompts, greedy, use_tqdm=False))
    assert_no_leak(narrow)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make_llm(kv_cache_dtype="fp8")
