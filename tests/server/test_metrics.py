"""Metrics at /metrics and the request log, checked against what the test did.

Most tests run an LLMEngine over a fake runner (one token per step, no model: milliseconds)
and a word-level tokenizer, stepped on the test thread, with the server's Prometheus wiring
(`make_server_app`); /metrics is read through the ASGI app. The last test reads /metrics of
the shared server after a real request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers

from octavo.config import CacheConfig, EngineConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler_output import SchedulerOutput
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app

VOCAB_SIZE = 64
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 5
MODEL = "fake"


class FakeRunner:
    """Samples SAMPLED_TOKEN_ID for each request whose known tokens are all computed after
    the step; keeps token counts from the SchedulerOutput deltas, as the real runner does."""

    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.preempted_req_ids | out.finished_req_ids:
            self.num_tokens.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            self.num_tokens[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            self.num_computed[cached.request_id] = cached.num_computed_tokens
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in req_ids:
            num_known = self.num_computed[request_id] + out.num_scheduled_tokens[request_id]
            if num_known >= self.num_tokens[request_id]:
                sampled.append([SAMPLED_TOKEN_ID])
                self.num_tokens[request_id] += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))

    def sleep(self, level: int) -> None:
        """Nothing to release: the core has ended every request."""

    def wake_up(self, tags) -> None:
        pass


def word_tokenizer() -> Tokenizer:
    """Token i is the word "t{i}"; decoding joins words with spaces."""
    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def make_engine(
    request_log: str | None,
    admission: str = "current",
    enable_sleep_mode: bool = False,
    kv_cache_metrics_sample: float = 0.0,
) -> LLMEngine:
    """10 blocks of 4 tokens, the scheduler tests' pool."""
    config = EngineConfig(
        model=MODEL,
        served_model_name=MODEL,
        dtype="float32",
        dtype_reason="test",
        device="cpu",
        seed=0,
        cache=CacheConfig(
            block_size=4, num_blocks=10, kv_cache_metrics_sample=kv_cache_metrics_sample
        ),
        scheduler=SchedulerConfig(16, 64, 64, admission=admission),
        request_log=request_log,
        enable_sleep_mode=enable_sleep_mode,
    )
    return LLMEngine(config, FakeRunner(), word_tokenizer(), (EOS_TOKEN_ID,))


def scrape(app) -> tuple[dict[str, float], dict[str, str]]:
    """Sample values by series (name{labels}) and the TYPE of each metric family."""

    async def get() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            response = await client.get("/metrics")
            assert response.status_code == 200
            return response.text

    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in asyncio.run(get()).splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            values[series] = float(value)
    return values, types


def run_to_completion(engine: LLMEngine, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("requests did not finish")


def series(name: str, **labels: str) -> str:
    labels = {**labels, "model_name": MODEL, "engine": "0"}
    inner = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def test_metrics_and_request_log_agree_with_what_ran(tmp_path) -> None:
    """a (15 prompt tokens, 3 answer tokens) and b (24, 2) fill the 10 blocks; at step 2 b
    needs a block and, being the newest, evicts itself; it resumes from its cached prompt
    after a finishes. Then c stops on a stop token, d on a stop string, e is aborted while
    waiting."""
    log_path = tmp_path / "requests.jsonl"
    engine = make_engine(str(log_path))
    app = make_server_app(engine, ServerConfig())
    engine.add_request("a", list(range(10, 25)), SamplingParams(max_tokens=3))
    engine.add_request("b", list(range(30, 54)), SamplingParams(max_tokens=2))
    run_to_completion(engine)
    engine.add_request(
        "c", [54, 55, 56, 57], SamplingParams(max_tokens=8, stop_token_ids=[SAMPLED_TOKEN_ID])
    )
    engine.add_request("d", [58, 59, 60, 61], SamplingParams(max_tokens=8, stop=["t5"]))
    engine.add_request("e", [10, 11, 12, 13], SamplingParams(max_tokens=8))
    engine.abort_request("e")
    run_to_completion(engine)
    engine.scheduler.check_integrity()

    values, types = scrape(app)
    expected = {
        series("vllm:num_requests_running"): 0,
        series("vllm:num_requests_waiting"): 0,
        series("vllm:kv_cache_usage_perc"): 0,
        series("vllm:num_preemptions_total"): 1,
        # Queried at admission: a 15, b 24, b again at resume 25, c 4, d 4. b's 6 prompt
        # blocks stayed cached when it was evicted, but a's next block took the LRU one, b's
        # tail: 5 hit.
        series("vllm:prefix_cache_queries_total"): 72,
        series("vllm:prefix_cache_hits_total"): 20,
        # Counted once a request's first token is out: e never had one.
        series("vllm:prompt_tokens_total"): 15 + 24 + 4 + 4,
        series("vllm:generation_tokens_total"): 3 + 2 + 1 + 1,
        series("vllm:request_success_total", finished_reason="length"): 2,
        series("vllm:request_success_total", finished_reason="stop"): 2,
        series("vllm:request_success_total", finished_reason="abort"): 1,
        series("vllm:time_to_first_token_seconds_count"): 4,
        # a's 2nd and 3rd tokens, b's 2nd.
        series("vllm:inter_token_latency_seconds_count"): 3,
        series("vllm:e2e_request_latency_seconds_count"): 5,
        series("vllm:request_queue_time_seconds_count"): 5,
        series("vllm:request_prefill_time_seconds_count"): 4,
        series("vllm:request_decode_time_seconds_count"): 4,
        series("vllm:request_prompt_tokens_sum"): 15 + 24 + 4 + 4 + 4,
        series("vllm:request_generation_tokens_sum"): 7,
        series("vllm:request_generation_tokens_count"): 5,
        # Steps: 4 for a and b (b's resume waits for a and recomputes 25 - 20 tokens), 1 for
        # c and d.
        series("vllm:iteration_tokens_total_count"): 5,
        series("vllm:iteration_tokens_total_sum"): (15 + 24) + 1 + 1 + 5 + (4 + 4),
        series("octavo:num_requests_evicted_total"): 1,
        series("octavo:eviction_freeze_seconds_count"): 1,
        # Only a and b have two tokens.
        series("octavo:request_max_token_gap_seconds_count"): 2,
    }
    assert {key: values.get(key) for key in expected} == expected
    for name, kind in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_preemptions_total", "counter"),
        ("vllm:request_success_total", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("octavo:request_max_token_gap_seconds", "histogram"),
    ):
        assert types[name] == kind

    lines = {
        entry["request_id"]: entry for entry in map(json.loads, log_path.read_text().splitlines())
    }
    assert {
        r: (
            e["prompt_tokens"],
            e["completion_tokens"],
            e["max_tokens"],
            e["finish_reason"],
            e["evictions"],
            len(e["eviction_freezes_s"]),
        )
        for r, e in lines.items()
    } == {
        "a": (15, 3, 3, "length", 0, 0),
        "b": (24, 2, 2, "length", 1, 1),
        "c": (4, 1, 8, "stop", 0, 0),
        "d": (4, 1, 8, "stop", 0, 0),
        "e": (4, 0, 8, "abort", 0, 0),
    }
    b = lines["b"]
    # b's gap spans its freeze (first token -> eviction -> resumed token).
    assert b["max_token_gap_s"] >= b["eviction_freezes_s"][0] > 0
    assert b["ttft_s"] > 0 and lines["e"]["ttft_s"] is None
    assert lines["a"]["ttft_s"] <= lines["a"]["e2e_latency_s"]


def test_prompt_token_sources_and_n_through_the_engine() -> None:
    """a's 9-token prompt is all computed. b asks for the same prompt with n=2 after a
    finished: each child finds a's two full blocks (8 tokens) in the prefix cache and computes
    the last token. The n and the longest completion are counted once per caller's request."""
    engine = make_engine(None)
    app = make_server_app(engine, ServerConfig())
    prompt = list(range(10, 19))
    engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    run_to_completion(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, n=2))
    run_to_completion(engine)
    engine.scheduler.check_integrity()

    values, types = scrape(app)
    expected = {
        series("vllm:prompt_tokens_total"): 9 * 3,
        series("vllm:prompt_tokens_by_source_total", source="local_compute"): 9 + 1 + 1,
        series("vllm:prompt_tokens_by_source_total", source="local_cache_hit"): 8 + 8,
        series("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"): 0,
        series("vllm:prompt_tokens_cached_total"): 16,
        series("vllm:request_prefill_kv_computed_tokens_sum"): 9 + 1 + 1,
        series("vllm:request_prefill_kv_computed_tokens_count"): 3,
        series("vllm:request_params_n_count"): 2,
        series("vllm:request_params_n_sum"): 1 + 2,
        series("vllm:request_params_n_bucket", le="1.0"): 1,
        series("vllm:request_max_num_generation_tokens_sum"): 2 + 3,
        series("vllm:request_max_num_generation_tokens_count"): 2,
        # One per stream that produced a token (a single-token stream records 0).
        series("vllm:request_time_per_output_token_seconds_count"): 3,
        series("vllm:num_requests_waiting_by_reason", reason="capacity"): 0,
        series("vllm:num_requests_waiting_by_reason", reason="deferred"): 0,
    }
    assert {key: values.get(key) for key in expected} == expected
    assert types["vllm:prompt_tokens_by_source_total"] == "counter"
    assert types["vllm:num_requests_waiting_by_reason"] == "gauge"


@pytest.mark.parametrize(
    "admission,num_preemptions", [("current", 1), ("reserve", 0), ("ratio", 0)]
)
def test_preemptions_by_policy(admission: str, num_preemptions: int) -> None:
    """The same two requests: only `current` admits b beside a and later evicts it; reserve
    and ratio (a still reserves 1 more block; b needs all of its 7) keep b waiting."""
    engine = make_engine(None, admission)
    app = make_server_app(engine, ServerConfig())
    engine.add_request("a", list(range(10, 25)), SamplingParams(max_tokens=3))
    engine.add_request("b", list(range(30, 54)), SamplingParams(max_tokens=2))
    run_to_completion(engine)
    values, _ = scrape(app)
    assert values[series("vllm:num_preemptions_total")] == num_preemptions
    assert values[series("octavo:num_requests_evicted_total")] == num_preemptions
    assert values[series("vllm:request_success_total", finished_reason="length")] == 2
    assert len(engine.stats_tracker) == 0


def test_sleep_state_and_operations_through_the_engine() -> None:
    """sleep(1) aborts the running request and shows at once, without a step: the engine is
    asleep with its weights "offloaded" (vLLM's level-1 state), and one sleep took some time.
    After wake_up it is awake again, and one wake-up is counted."""
    engine = make_engine(None, enable_sleep_mode=True)
    app = make_server_app(engine, ServerConfig())

    def state(values: dict[str, float]) -> tuple[float, ...]:
        return tuple(
            values[series("vllm:engine_sleep_state", sleep_state=s)]
            for s in ("awake", "weights_offloaded", "discard_all")
        )

    def operations(values: dict[str, float], operation: str) -> float:
        name = "vllm:sleep_mode_operation_duration_seconds_count"
        return values.get(f'{name}{{operation="{operation}"}}', 0)

    values, types = scrape(app)
    assert state(values) == (1, 0, 0) and operations(values, "sleep") == 0
    engine.add_request("a", list(range(10, 19)), SamplingParams(max_tokens=8))
    engine.step()
    engine.sleep(1)
    values, types = scrape(app)
    assert state(values) == (0, 1, 0)
    assert (operations(values, "sleep"), operations(values, "wake")) == (1, 0)
    assert values[series("vllm:request_success_total", finished_reason="abort")] == 1
    assert types["vllm:sleep_mode_operation_duration_seconds"] == "histogram"
    engine.wake_up()
    values, _ = scrape(app)
    assert state(values) == (1, 0, 0)
    assert (operations(values, "sleep"), operations(values, "wake")) == (1, 1)
    run_to_completion(engine)
    engine.scheduler.check_integrity()


def test_kv_block_residency_through_the_engine() -> None:
    """Every block sampled. a (9 prompt tokens, 2 answer tokens) takes blocks 0, 1, 2; its two
    full prompt blocks stay cached, and b and c, the same prompt, hit them (block 1: two hits,
    one reuse gap) and take block 2 again for their last token (two lives of block 2 end).
    d's 33-token prompt takes the 9 blocks 2-9 and 1: block 2's third life and block 1's
    end. Ends: 4 lives (lifetime and idle time each), 1 gap; block 0 still lives."""
    engine = make_engine(None, kv_cache_metrics_sample=1.0)
    app = make_server_app(engine, ServerConfig())
    prompt = list(range(10, 19))
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2))
        run_to_completion(engine)
    engine.add_request("d", list(range(20, 53)), SamplingParams(max_tokens=1))
    run_to_completion(engine)
    engine.scheduler.check_integrity()
    values, types = scrape(app)
    assert values[series("vllm:prefix_cache_hits_total")] == 16
    for name, count in (("lifetime", 4), ("idle_before_evict", 4), ("reuse_gap", 1)):
        assert types[f"vllm:kv_block_{name}_seconds"] == "histogram"
        assert values[series(f"vllm:kv_block_{name}_seconds_count")] == count, name
    # Off by default: none of them is exported.
    assert not any(
        "kv_block" in key for key in scrape(make_server_app(make_engine(None), ServerConfig()))[0]
    )


# The shared server's model name and every metric family it must expose, with its type.
SERVER_MODEL = "SmolLM2-135M-Instruct"
FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "octavo:request_max_token_gap_seconds": "histogram",
    "octavo:num_requests_evicted_total": "counter",
    "octavo:eviction_freeze_seconds": "histogram",
}


def test_server_metrics_after_a_streamed_request(server, http) -> None:
    def scrape_server() -> tuple[dict[str, float], dict[str, str]]:
        values, types = {}, {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("# TYPE"):
                _, _, name, kind = line.split(" ")
                types[name] = kind
            elif line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values, types

    def key(name: str, **labels: str) -> str:
        labels = {**labels, "model_name": SERVER_MODEL, "engine": "0"}
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    server.wait_idle()
    before, _ = scrape_server()
    body = {
        "model": SERVER_MODEL,
        "prompt": "Count: one two",
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    num_prompt = http.post("/tokenize", json={"prompt": "Count: one two"}).json()["count"]
    server.wait_idle()
    after, types = scrape_server()
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, name

    def delta(name: str, **labels: str) -> float:
        return after[key(name, **labels)] - before[key(name, **labels)]

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == num_prompt
    assert delta("vllm:num_preemptions_total") == 0
    assert delta("octavo:num_requests_evicted_total") == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert delta("vllm:request_prompt_tokens_sum") == num_prompt
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert delta("octavo:request_max_token_gap_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == num_prompt
    assert (
        delta("vllm:e2e_request_latency_seconds_sum")
        >= delta("vllm:time_to_first_token_seconds_sum")
        > 0
    )
    assert after[key("vllm:num_requests_running")] == 0


# The series vLLM's example Grafana dashboards read (benchmarks/vllm_dashboard_series.py).
DASHBOARD_SERIES = Path(__file__).parents[1] / "data" / "vllm_dashboard_series.json"


def test_every_series_vllms_dashboards_read_is_served(server, http) -> None:
    """After a request and a sleep (level 0) and wake-up, /metrics serves every series named
    by the PromQL of vLLM's example dashboards, labelled with the model and the engine (or
    with vLLM's own labels where the data names them), with each label value a query filters
    on (finished_reason="error", reason="deferred", sleep_state="discard_all", a TTFT bucket
    bound, ...). A series that cannot mean anything here must say why in the data, not be
    skipped."""
    body = {"model": SERVER_MODEL, "prompt": "Count: one two", "max_tokens": 3, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    server.wait_idle()
    assert http.post("/sleep?level=0").status_code == 200
    assert http.post("/wake_up").status_code == 200
    samples: dict[str, list[dict[str, str]]] = defaultdict(list)
    deadline = time.monotonic() + 30
    # The engine core's stats after the wake-up reach /metrics a moment after its reply.
    while not any(
        s.get("operation") == "wake"
        for s in samples["vllm:sleep_mode_operation_duration_seconds_count"]
    ):
        assert time.monotonic() < deadline, "no wake-up at /metrics"
        time.sleep(0.05)
        samples.clear()
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                samples[sample.name].append(sample.labels)

    data = json.loads(DASHBOARD_SERIES.read_text())
    assert data["dashboards"] and data["series"]
    missing, unlabelled = [], []
    for entry in data["series"]:
        if "not_applicable" in entry or "from_prometheus" in entry:
            assert entry.get("not_applicable") or entry.get("from_prometheus"), entry
            continue
        name = entry.get("served_as", entry["name"])
        if name not in samples:
            missing.append(name)
            continue
        labels = samples[name]
        wanted = {"model_name": SERVER_MODEL, "engine": "0"}
        required = entry.get("labels", list(wanted))
        if name.startswith("vllm:") and not any(
            all(label in s and wanted.get(label, s[label]) == s[label] for label in required)
            for s in labels
        ):
            unlabelled.append(name)
        for label, values in entry.get("label_values", {}).items():
            for value in values:
                if not any(s.get(label) == value for s in labels):
                    missing.append(f"{name}{{{label}={value!r}}}")
    assert missing == [] and unlabelled == []


def test_admission_flags_reach_the_resolved_config() -> None:
    from octavo.entrypoints.cli import engine_args_from, make_parser

    ns = make_parser().parse_args(
        [
            "serve",
            "--admission",
            "ratio",
            "--watermark",
            "0.1",
            "--preempt-victim",
            "newest",
            "--request-log",
            "r.jsonl",
        ]
    )
    args = engine_args_from(ns)
    assert (args.admission, args.watermark, args.preempt_victim, args.request_log) == (
        "ratio",
        0.1,
        "newest",
        "r.jsonl",
    )
    defaults = engine_args_from(make_parser().parse_args(["serve"]))
    assert (defaults.admission, defaults.watermark, defaults.preempt_victim) == (
        "current",
        0.0,
        None,
    )
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--admission", "tgi"])
    resolved = json.loads(make_engine(None, "reserve").config.to_json())
    assert resolved["scheduler"]["admission"] == "reserve"
    assert resolved["scheduler"]["watermark"] == 0.0 and resolved["request_log"] is None
