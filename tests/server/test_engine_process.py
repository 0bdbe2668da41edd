"""The engine core in its own process: the messages across the boundary come back as they went,
and the processes end together: a killed server leaves no engine-core process behind, and a
killed engine core fails its requests, turns /health to 503 and makes the server exit 1."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from octavo.core.outputs import EngineCoreOutput, TokenLogprobs
from octavo.core.request import FinishReason, ResolvedParams
from octavo.core.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.engine import serial
from octavo.engine.core import EngineCoreRequest
from octavo.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)

from .utils import free_port, start_serve, stream_events


def _through(message: list) -> list:
    return serial.unpack(serial.pack(message))


def test_requests_outputs_and_stats_cross_the_boundary_unchanged() -> None:
    request = EngineCoreRequest(
        "0_req",
        [1, 2, 3],
        SamplingParams(
            temperature=0.7,
            top_k=5,
            seed=3,
            stop=["\n"],
            stop_token_ids=[9],
            logprobs=2,
            logit_bias={17: -2.5},
            structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        ),
        ResolvedParams(40, frozenset({2, 9})),
        123.25,
        priority=-3,
    )
    (item,) = _through([serial.encode_request(request)])
    assert serial.decode_request(item) == request

    outputs = [
        EngineCoreOutput("a", [5], [TokenLogprobs([5, 6], [-0.5, -1.5], 1)]),
        EngineCoreOutput("b", [7], None, FinishReason.STOP, stop_reason=7, num_cached_tokens=16),
        EngineCoreOutput("c", [], None, FinishReason.ERROR, error="why"),
    ]
    items = _through([serial.encode_output(output) for output in outputs])
    assert [serial.decode_output(item) for item in items] == outputs

    finished = FinishedRequestStats(
        "b", FinishReason.LENGTH, 3, 4, 4, 1.5, 0.25, 0.5, 0.25, 1.0, 0.4, 1, (0.3,)
    )
    iteration = IterationStats(
        num_scheduled_tokens=9,
        num_prompt_tokens=3,
        num_generation_tokens=2,
        time_to_first_tokens_s=[0.5],
        inter_token_latencies_s=[0.1],
        finished_requests=[finished],
    )
    (encoded,) = _through([serial.encode_iteration_stats(iteration)])
    assert serial.decode_iteration_stats(encoded) == iteration
    scheduler = SchedulerStats(1, 2, 0.5, 3, 40, 16, 10, 20)
    (encoded,) = _through([serial.encode_scheduler_stats(scheduler)])
    assert serial.decode_scheduler_stats(encoded) == scheduler
    speculative = SchedulerStats(1, spec_decoding=SpecDecodingStats(3, 9, 4, (2, 1, 1)))
    (encoded,) = _through([serial.encode_scheduler_stats(speculative)])
    assert serial.decode_scheduler_stats(encoded) == speculative


def _engine_core(server: subprocess.Popen) -> psutil.Process:
    children = psutil.Process(server.pid).children(recursive=True)
    cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 1, [c.cmdline() for c in children]
    return cores[0]


@pytest.mark.slow
def test_the_request_log_across_the_boundary_and_no_core_left_behind(tmp_path) -> None:
    """A request ended by a stop string (found in the server process, aborted in the core)
    is logged once with finish reason stop; then SIGKILL of the server takes the core too."""
    log = tmp_path / "requests.jsonl"
    port = free_port()
    server = start_serve(port, "--request-log", str(log))
    try:
        core = _engine_core(server)

        def complete(**fields) -> dict:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40}
            body |= {"temperature": 0, "ignore_eos": True}
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json=body | fields,
                headers={"Authorization": "Bearer k"},
                timeout=60,
            )
            return response.json()["choices"][0]

        # The random model's greedy text names a stop string it is sure to meet.
        text = complete()["text"]
        stop = text[len(text) // 2]
        choice = complete(stop=[stop])
        assert choice["finish_reason"] == "stop", choice
        assert choice["text"] == text[: text.index(stop)], (choice, text)
        deadline = time.monotonic() + 10
        while not log.exists() or len(log.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline, "no request log line"
            time.sleep(0.1)
        first, entry = [json.loads(line) for line in log.read_text().splitlines()]
        assert first["finish_reason"] == "length", first
        assert entry["finish_reason"] == "stop" and entry["completion_tokens"] >= 1, entry
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        # The core sees its pipe close and exits by itself.
        core.wait(10)
        assert not core.is_running()
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_a_dead_engine_core_fails_its_requests_and_stops_the_server() -> None:
    port = free_port()
    server = start_serve(port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        core = _engine_core(server)
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
        lines = stream_events(base_url, body, core.kill)
        # The stream ends with an error event and [DONE], not a cut connection.
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert error["type"] == "server_error" and "engine" in error["message"], error
        # Until it has closed, the server says it is not healthy.
        try:
            assert httpx.get(base_url + "/health", timeout=5).status_code == 503
        except httpx.ConnectError:
            pass  # closed already
        assert server.wait(30) == 1
    finally:
        if server.poll() is None:
            server.kill()
