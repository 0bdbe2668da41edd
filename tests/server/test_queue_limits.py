"""--max-num-queued-reqs over HTTP, on the slow mock engine: a request beyond the bound gets
503 with OpenAI's error object at once (a stream too: a status, not an error event), while the
requests already in flight complete; the offline LLM takes every prompt, as vLLM's does. And
--max-queue-wait: 503 with the predicted wait as Retry-After, for exactly the requests whose
predicted time to first token is over it."""

from __future__ import annotations

import threading
import time

import httpx

from octavo import SamplingParams

from ..mock_engine import mock_llm
from .mock_server import GatedMockRunner, mock_server

COMPLETIONS = "/v1/completions"


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_request_beyond_max_num_queued_reqs_gets_503_while_the_others_complete() -> None:
    with mock_server(slow=True, scheduler={"max_num_queued_reqs": 1}) as running:
        lines: list[str] = []

        def read() -> None:
            body = {"prompt": "the cat", "max_tokens": 20, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", running.base_url + COMPLETIONS, json=body, timeout=60) as r:
                assert r.status_code == 200
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        _wait_for(lambda: running.async_engine.queue_limits.num_reqs == 1)
        with httpx.Client(base_url=running.base_url, timeout=30) as client:
            for stream in (False, True):
                started = time.monotonic()
                body = {"prompt": "the cat", "max_tokens": 2, "stream": stream}
                response = client.post(COMPLETIONS, json=body)
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "1"
                assert time.monotonic() - started < 1.0  # at once, not after the running one
                error = response.json()["error"]
                assert error["type"] == "server_error"
                assert "--max-num-queued-reqs" in error["message"]
            reader.join(30)
            assert lines[-1] == "data: [DONE]"
            assert not any('"error"' in line for line in lines)
            assert running.async_engine.queue_limits.num_reqs == 0
            response = client.post(COMPLETIONS, json={"prompt": "the cat", "max_tokens": 2})
            assert response.status_code == 200
            assert response.json()["choices"][0]["finish_reason"] == "length"
            # Both rejections counted by the bound that made them (vLLM's series).
            metrics = client.get("/metrics").text
            series = 'vllm:admission_rejections_total{model_name="mock",reason="%s"}'
            assert series % "max_num_queued_reqs" + " 2.0" in metrics
            assert series % "max_num_queued_tokens" + " 0.0" in metrics


def test_the_offline_llm_takes_every_prompt_whatever_the_bounds() -> None:
    """vLLM checks the bounds in its serving frontend only; LLM.generate submits all at once."""
    llm = mock_llm(max_num_queued_reqs=1, max_num_queued_tokens=1, max_queue_wait_s=1e-9)
    outputs = llm.generate(["the cat"] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3, 3]


def test_max_queue_wait_sheds_exactly_the_requests_predicted_over_it() -> None:
    """Fixed rates (0.1 s a step, 0.01 s a prompt token, 64 tokens a step) and a held engine:
    each request's predicted TTFT is ceil(T / 64) * 0.1 + T * 0.01 for the T prompt tokens
    ahead of and in it, against --max-queue-wait 0.95. Seven 10-word prompts fit (up to 0.9
    s), the eighth does not (1.0 s: 503, Retry-After 1); a 2-word one still fits behind them
    (0.92 s), a 40-word one does not (1.32 s: Retry-After 2). Once the engine runs, every
    admitted request ends with all of its tokens."""
    llm = mock_llm(max_model_len=128, max_queue_wait_s=0.95)
    llm.llm_engine.model_runner.__class__ = GatedMockRunner
    GatedMockRunner.gate = threading.Event()
    prompts = [" ".join(["the"] * 10)] * 8 + ["the cat", " ".join(["the"] * 40)]
    # What each prompt gets from the same engine with no bound (the offline LLM).
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    expected = {p: o.outputs[0].text for p, o in zip(prompts, mock_llm().generate(prompts, params))}
    with mock_server(llm=llm) as running:
        rates = running.async_engine.step_rates
        rates.decode_step_s, rates.prompt_token_s = 0.1, 0.01
        limits = running.async_engine.queue_limits
        responses: dict[int, httpx.Response] = {}

        def send(index: int) -> None:
            body = {"prompt": prompts[index], "max_tokens": 3, "ignore_eos": True}
            body["temperature"] = 0
            responses[index] = httpx.post(running.base_url + COMPLETIONS, json=body, timeout=60)

        threads = []
        for index in range(len(prompts)):
            admitted = limits.num_reqs
            threads.append(threading.Thread(target=send, args=(index,), daemon=True))
            threads[-1].start()
            _wait_for(lambda i=index, n=admitted: i in responses or limits.num_reqs > n)
        shed = sorted(responses)
        assert shed == [7, 9]
        assert [responses[i].headers["retry-after"] for i in shed] == ["1", "2"]
        for index in shed:
            assert responses[index].status_code == 503
            error = responses[index].json()["error"]
            assert error["type"] == "server_error" and "--max-queue-wait" in error["message"]
        assert limits.num_prefill_tokens == 7 * 10 + 2
        GatedMockRunner.gate.set()
        for thread in threads:
            thread.join(30)
        for index in sorted(set(range(len(prompts))) - set(shed)):
            response = responses[index]
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == 3
            assert choice["text"] == expected[prompts[index]]
        assert (limits.num_reqs, limits.num_prefill_tokens) == (0, 0)
        metrics = httpx.get(running.base_url + "/metrics").text
        series = 'vllm:admission_rejections_total{model_name="mock",reason="max_queue_wait"}'
        assert series + " 2.0" in metrics
