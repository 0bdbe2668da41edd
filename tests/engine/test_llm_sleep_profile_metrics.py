"""vLLM's offline control methods: `sleep` / `wake_up` / `is_sleeping`, `start_profile` /
`stop_profile` and `get_metrics`, on the embedded model (sleep, profile) and the mock engine
(the rules, the metrics).

The embedded model is loaded for this module alone (not shared with other engines, as
tests/integration does), so that a level 2 sleep really drops the weights and wake_up really
reloads them from the model file.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from octavo import LLM, SamplingParams
from octavo.metrics.reader import Counter, Gauge, Histogram
from tests.mock_engine import mock_llm

PROMPTS = ["The capital of France is", "List three colors:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
# 2,048 tokens of float32 KV for the embedded model (30 layers, 3 KV heads of 64): ~94 MB.
KV_CACHE_TOKENS = 2048


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def llm(trace_dir: str) -> LLM:
    return LLM(
        dtype="float32",
        max_model_len=512,
        kv_cache_tokens=KV_CACHE_TOKENS,
        block_size=16,
        seed=0,
        enable_sleep_mode=True,
        profiler_config={"profiler": "torch", "torch_profiler_dir": trace_dir},
    )


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_level_1_frees_the_kv_cache_and_wakes_to_the_same_tokens(llm: LLM) -> None:
    runner = llm.llm_engine.model_runner
    before = _tokens(llm)
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    model = runner.model
    rss = _rss_bytes()
    llm.sleep(level=1)
    freed = rss - _rss_bytes()
    assert llm.is_sleeping()
    assert runner.kv_caches == []
    assert runner.model is model  # on a CPU the weights stay in host memory
    assert freed > kv_bytes // 2, (freed, kv_bytes)
    block_pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert not block_pool.cached_block_map  # the prefix cache went with the KV contents
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == before
    llm.llm_engine.check_integrity()


def test_level_2_drops_the_weights_and_reloads_them(llm: LLM) -> None:
    runner = llm.llm_engine.model_runner
    before = _tokens(llm)
    old_model = weakref.ref(runner.model)
    old_kv = weakref.ref(runner.kv_caches[0])
    llm.sleep(level=2)
    gc.collect()
    assert runner.model is None and runner.kv_caches == []
    assert old_model() is None and old_kv() is None  # really released, not just unreferenced
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()  # scheduling is still asleep (vLLM's tags)
    llm.wake_up(tags=["scheduling"])
    assert not llm.is_sleeping()
    assert runner.model is not None
    assert _tokens(llm) == before


def test_sleep_aborts_requests_in_flight(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("in-flight", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    llm.sleep(level=1)
    outputs = engine.step()  # asleep, a step only delivers the aborts
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [
        ("in-flight", True, "abort")
    ]
    assert not engine.has_unfinished_requests()
    llm.wake_up()
    engine.check_integrity()
    stats = engine.make_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_level_0_pauses_and_requests_wait_for_wake_up(llm: LLM) -> None:
    engine = llm.llm_engine
    llm.sleep(level=0)
    assert llm.llm_engine.model_runner.kv_caches  # nothing is released at level 0
    engine.add_request("waits", PROMPTS[0], SamplingParams(max_tokens=2))
    assert engine.step() == [] and engine.has_unfinished_requests()
    llm.wake_up(tags=["scheduling"])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in finished] == [2]


def test_the_profiler_writes_a_trace_of_the_steps(llm: LLM, trace_dir: str) -> None:
    llm.start_profile()
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.stop_profile()
    traces = [name for name in os.listdir(trace_dir) if ".pt.trace.json" in name]
    assert traces and all(os.path.getsize(os.path.join(trace_dir, t)) > 0 for t in traces)


def test_sleep_and_the_profiler_need_their_settings() -> None:
    llm = mock_llm()
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="Profiler is not enabled"):
        llm.start_profile()
    assert not llm.is_sleeping()


def test_get_metrics_counts_what_generate_did() -> None:
    llm = mock_llm()
    outputs = llm.generate(["the cat", "a dog ran"], SamplingParams(max_tokens=3))
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    prompt = metrics[("vllm:prompt_tokens", None)]
    generation = metrics[("vllm:generation_tokens", None)]
    assert isinstance(prompt, Counter) and isinstance(generation, Counter)
    assert prompt.value == sum(len(o.prompt_token_ids) for o in outputs) == 5
    assert generation.value == sum(len(o.outputs[0].token_ids) for o in outputs) == 6
    assert prompt.labels == {"model_name": "mock", "engine": "0"}
    assert metrics[("vllm:request_success", "length")].value == 2
    running = metrics[("vllm:num_requests_running", None)]
    assert isinstance(running, Gauge) and running.value == 0
    lengths = metrics[("vllm:request_generation_tokens", None)]
    assert isinstance(lengths, Histogram)
    assert (lengths.count, lengths.sum, lengths.buckets["+Inf"]) == (2, 6.0, 2)
    assert all(m.name.startswith(("vllm:", "octavo:")) for m in metrics.values())
