"""`octavo serve` as users run it (a subprocess: SIGTERM finishes in-flight streams and exits
0), and `octavo bench serve` against the shared test server."""

from __future__ import annotations

import json
import os
import signal
import stat

import httpx
import pytest

from octavo.entrypoints.cli import main

from .utils import free_port, start_serve, stream_events

pytestmark = pytest.mark.slow


def test_serve_finishes_streams_on_sigterm_and_exits_zero() -> None:
    port = free_port()
    process = start_serve(port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "ignore_eos": True}
        lines = stream_events(base_url, body, lambda: process.send_signal(signal.SIGTERM))
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])["choices"][0]
        assert last["finish_reason"] == "length"
        assert len(lines) == 21  # 20 token chunks and [DONE]: the stream was finished
        assert process.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(base_url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_on_a_unix_domain_socket(tmp_path) -> None:
    """--uds PATH (vLLM's): the server listens on that socket file instead of the port. A
    request over it runs in the engine-core process, here with its `priority` under
    --scheduling-policy priority (carried across the process boundary)."""
    path = str(tmp_path / "octavo.sock")
    assert len(path) < 100  # AF_UNIX paths are short
    port = free_port()
    process = start_serve(port, "--scheduling-policy", "priority", uds=path)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=path),
            base_url="http://localhost",
            headers={"Authorization": "Bearer k"},
            timeout=60,
        ) as client:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
            response = client.post("/v1/completions", json={**body, "priority": -2})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        process.terminate()
        process.wait(60)


def test_bench_serve_reports_and_ends_with_a_json_line(server, capsys) -> None:
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            server.api_key,
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--ignore-eos",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("config: ")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_input_tokens"] == 64 and result["total_output_tokens"] == 16
    assert result["output_throughput"] > 0 and result["median_ttft_ms"] > 0
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] > 0
