"""Engine behaviour on the embedded model: aborts in every state, n > 1, stops, limits, errors."""

from __future__ import annotations

import math

import pytest
import torch

from octavo import SamplingParams
from octavo.core.request import RequestStatus
from octavo.engine.output_processor import OutputKind

from .utils import assert_no_leak

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _step_until(engine, condition, max_steps: int = 200) -> list:
    """Step until `condition()` holds; returns the finished outputs seen on the way."""
    finished = []
    for _ in range(max_steps):
        if condition():
            return finished
        finished += [o for o in engine.step() if o.finished]
    raise AssertionError("condition not reached")


def test_abort_in_every_state_frees_blocks(make_llm) -> None:
    llm = make_llm(kv_cache_tokens=160, max_model_len=160, max_num_batched_tokens=8)
    engine = llm.llm_engine
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompt = list(range(1000, 1040))  # 40 tokens: 5 chunks of 8
    for i in range(4):
        engine.add_request(f"r{i}", prompt[: 30 + i], params, OutputKind.DELTA)

    # Waiting: nothing has run yet.
    engine.abort_request("r3")
    assert scheduler.get_request("r3") is None or scheduler.get_request("r3").is_finished
    # Mid-prefill: one step computes 8 of r0's 30 prompt tokens.
    finished = [o for o in engine.step() if o.finished]
    r0 = scheduler.get_request("r0")
    assert 0 < r0.num_computed_tokens < r0.num_prompt_tokens
    engine.abort_request("r0")
    # Running and preempted: r1 and r2 decode until the 10-block pool runs out.
    finished += _step_until(engine, lambda: engine.make_stats().num_preemptions > 0)
    preempted = [
        rid
        for rid in ("r1", "r2")
        if scheduler.get_request(rid) is not None
        and scheduler.get_request(rid).status == RequestStatus.PREEMPTED
    ]
    assert preempted, "expected a preempted request"
    engine.abort_request(preempted)
    running = [rid for rid in ("r1", "r2") if rid not in preempted]
    finished += _step_until(
        engine, lambda: scheduler.get_request(running[0]).status == RequestStatus.RUNNING
    )
    engine.abort_request(running)
    finished += [o for o in engine.step() if o.finished]
    # Every request ended once, with finish_reason "abort".
    assert sorted(o.request_id for o in finished) == ["r0", "r1", "r2", "r3"]
    assert all(o.outputs[0].finish_reason == "abort" for o in finished)
    assert_no_leak(llm)


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


def test_n_greater_than_one_shares_the_prompt(llm) -> None:
    prompt = "Write a short poem about the sea. " * 6
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 16 or c.finish_reason == "stop" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1, "children sampled alike"
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == [c.text for c in output.outputs]
    assert again.num_cached_tokens > 0
    assert_no_leak(llm)


def test_stop_string_is_excluded_even_across_tokens(llm) -> None:
    free = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 12
    # A stop string that starts inside one token and ends inside a later one.
    stop = text[3:9]
    stopped = llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
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


def test_stop_token_ids_and_max_model_len(make_llm, llm) -> None:
    out = llm.generate(["Count: 1, 2, 3,"], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = out.token_ids[3]
    stopped = llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id

    short = make_llm(max_model_len=32)
    prompt = list(range(1000, 1020))
    capped = short.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(capped.outputs[0].token_ids) == 12 and capped.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate([prompt], SamplingParams(max_tokens=13), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate([list(range(1000, 1040))], SamplingParams(max_tokens=1), use_tqdm=False)
    assert_no_leak(short)


def test_invalid_requests_are_rejected_before_admission(llm) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**9]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    # One bad prompt rejects the whole call, and the good one is not left queued.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
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


def test_prompts_run_in_256_token_chunks_on_a_cpu_unless_set(make_llm, llm, monkeypatch) -> None:
    """The CPU default caps each prompt's chunk per step (a long prompt must not freeze the
    running streams); an explicit value, 0 included, is kept."""
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
    prompt = list(range(100, 550))  # 450 tokens: chunks of 256 and 194
    engine.add_request(
        "long", prompt, SamplingParams(temperature=0.0, max_tokens=2), OutputKind.FINAL_ONLY
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert chunks == [256, 194, 1]
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16_bit_kv_cache_holds_twice_the_tokens_and_decodes(make_llm, llm, kv_cache_dtype):
    """float32 compute over a 16-bit cache: half the bytes per token, so the same memory holds
    twice the tokens; bf16 decodes through the paged kernel, float16 (which the kernel does not
    read) through gathered blocks. Greedy text stays that of the float32 cache here."""
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
    expected = [o.outputs[0].token_ids for o in wide.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in narrow.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert_no_leak(narrow)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make_llm(kv_cache_dtype="fp8")
