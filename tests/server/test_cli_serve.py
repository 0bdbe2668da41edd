"""`octavo serve` as users run it (a subprocess: SIGTERM finishes in-flight streams and exits
0), and `octavo bench serve` against the shared test server."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from octavo.entrypoints.cli import main

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_finishes_streams_on_sigterm_and_exits_zero() -> None:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "octavo.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--api-key",
        "k",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-tokens",
        "2048",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 20,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        with httpx.stream(
            "POST",
            base_url + "/v1/completions",
            json=body,
            timeout=60,
            headers={"Authorization": "Bearer k"},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 2:
                    process.send_signal(signal.SIGTERM)
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
