"""The operator's endpoints: GET /v1/kv (KV pool and requests, read through the engine's
utility calls, in process on the mock engine and across the engine-core process on the
embedded model), GET /v1/config (the resolved configuration logged at start-up), and `octavo
top` drawn from them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from octavo.entrypoints.cli import main
from octavo.entrypoints.top import Sample, render

from ..mock_engine import mock_llm
from .conftest import RunningServer
from .mock_server import mock_server

# Nine words: two full 4-token blocks that a second request finds in the prefix cache.
PROMPT = "the cat sat on a mat and then it"


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _start_requests(base_url: str, num_requests: int, headers=None) -> list[threading.Thread]:
    def send() -> None:
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=60)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(num_requests)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # in order: the later ones find the first one's blocks
    return threads


def test_kv_shows_the_running_requests_their_blocks_and_what_they_share(capsys) -> None:
    with mock_server(slow=True, llm=mock_llm(max_model_len=128)) as running:
        threads = _start_requests(running.base_url, 3)
        with httpx.Client(base_url=running.base_url, timeout=30) as client:
            _wait_for(lambda: client.get("/v1/kv").json()["num_running_reqs"] == 3)
            kv = client.get("/v1/kv").json()
            assert kv["block_size"] == 4 and kv["num_blocks"] == 64
            held = sum(r["num_blocks"] for r in kv["requests"])
            # Each holds its own blocks beyond the two shared ones, held three times.
            assert kv["num_blocks"] - kv["num_free_blocks"] == held - 2 * 2
            assert kv["usage"] == pytest.approx(1 - kv["num_free_blocks"] / 64)
            assert [r["state"] for r in kv["requests"]] == ["running"] * 3
            assert [r["num_cached_tokens"] for r in kv["requests"]] == [0, 8, 8]
            assert all(r["num_shared_blocks"] == 2 for r in kv["requests"])
            assert all(r["num_prompt_tokens"] == 9 for r in kv["requests"])
            assert all(0 < r["num_output_tokens"] < 100 for r in kv["requests"])
            assert kv["prefix_cache_hits"] == 16
            assert kv["rates"]["tokens_per_s"] > 0
            assert kv["rates"]["decode_step_s"] == pytest.approx(0.05, rel=0.5)
            assert kv["queue"]["num_requests"] == 3
            assert len(kv["engines"]) == 1 and kv["engines"][0]["num_running_reqs"] == 3

            assert main(["top", running.base_url, "--once"]) == 0
            screen = capsys.readouterr().out
            assert "running 3" in screen and "KV  [" in screen
            assert screen.count(" running ") >= 3  # the table's rows
        for thread in threads:
            thread.join(30)


def test_config_is_the_document_logged_at_start_up() -> None:
    llm = mock_llm(max_model_len=128, max_queue_wait_s=2.5)
    with mock_server(llm=llm) as running:
        document = httpx.get(running.base_url + "/v1/config").json()
        assert document == json.loads(llm.llm_engine.config.to_json())
        assert document["scheduler"]["max_queue_wait_s"] == 2.5


def test_top_renders_one_screen_from_a_sample() -> None:
    kv = {
        "block_size": 16,
        "num_blocks": 100,
        "num_free_blocks": 75,
        "num_cached_blocks": 30,
        "usage": 0.25,
        "num_running_reqs": 1,
        "num_waiting_reqs": 1,
        "num_preemptions": 2,
        "num_evicted_cached_blocks": 3,
        "prefix_cache_queries": 200,
        "prefix_cache_hits": 50,
        "sleep_level": None,
        "rates": {
            "tokens_per_s": 1000.0,
            "generation_tokens_per_s": 40.0,
            "decode_step_s": 0.025,
            "prompt_token_s": 0.001,
        },
        "queue": {
            "num_requests": 2,
            "num_prompt_tokens": 300,
            "predicted_ttft_s": 0.33,
            "max_queue_wait_s": 2.0,
        },
        "requests": [
            {
                "request_id": "cmpl-abc-0",
                "engine": 0,
                "state": "running",
                "num_prompt_tokens": 400,
                "num_computed_tokens": 410,
                "num_output_tokens": 10,
                "max_tokens": 64,
                "num_blocks": 26,
                "num_shared_blocks": 4,
                "num_cached_tokens": 64,
                "num_preemptions": 1,
            },
            {
                "request_id": "cmpl-def-0",
                "engine": 0,
                "state": "waiting",
                "num_prompt_tokens": 300,
                "num_computed_tokens": 0,
                "num_output_tokens": 0,
                "max_tokens": 64,
                "num_blocks": 0,
                "num_shared_blocks": 0,
                "num_cached_tokens": 0,
                "num_preemptions": 0,
            },
        ],
    }
    counters = {
        "prompt_tokens": 1000.0,
        "generation_tokens": 500.0,
        "preemptions": 2.0,
        "evicted_requests": 1.0,
        "finished": 7.0,
        "shed": 1.0,
    }
    first = Sample(10.0, kv, counters, 2.0, 3.0)
    screen = render(first, None, "http://h:1", width=100).splitlines()
    bar = "#" * 15 + "." * 45
    assert screen[1] == f"KV  [{bar}]  25.0%  25/100 blocks of 16"
    assert "prefix hits 25% of 200 tokens" in screen[2]
    assert screen[3].startswith("Tokens/s  1000.0 run, 40.0 output")
    assert "running 1  waiting 1  finished 7  shed 1" in screen[4]
    assert screen[5] == (
        "Evictions  2 preemptions of 1 requests  freezes 2 since start (mean 1.50 s)"
    )
    assert screen[6] == "Queue  300 prompt tokens to prefill  predicted TTFT 0.33 s (shed over 2 s)"
    assert screen[9].split() == ["cmpl-abc-0", "0", "running", "400", "410", "10/64"] + [
        "26",
        "4",
        "64",
        "1",
    ]
    later = Sample(12.0, kv, {**counters, "generation_tokens": 600.0}, 2.0, 3.0)
    assert "output 50.0  (last 2.0 s)" in render(later, first)


@pytest.mark.slow
def test_kv_and_config_across_the_engine_core_process(
    server: RunningServer, http: httpx.Client
) -> None:
    threads = _start_requests(server.base_url, 2, server.headers)
    _wait_for(lambda: http.get("/v1/kv").json()["num_running_reqs"] == 2, 60)
    kv = http.get("/v1/kv").json()
    assert kv["block_size"] == 16 and kv["num_blocks"] == 16384 // 16
    assert [r["state"] for r in kv["requests"]] == ["running", "running"]
    assert all(r["num_blocks"] >= 1 for r in kv["requests"])
    for thread in threads:
        thread.join(120)
    config = http.get("/v1/config").json()
    assert config["scheduler"]["max_model_len"] == 1024
    assert config["backend_choices"]
    server.assert_no_leak()
