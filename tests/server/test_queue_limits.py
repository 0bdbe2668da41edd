"""--max-num-queued-reqs over HTTP, on the slow mock engine: a request beyond the bound gets
503 with OpenAI's error object at once (a stream too: a status, not an error event), while the
requests already in flight complete; the offline LLM takes every prompt, as vLLM's does."""

from __future__ import annotations

import threading
import time

import httpx

from octavo import SamplingParams

from ..mock_engine import mock_llm
from .mock_server import mock_server

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
    llm = mock_llm(max_num_queued_reqs=1, max_num_queued_tokens=1)
    outputs = llm.generate(["the cat"] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3, 3]
