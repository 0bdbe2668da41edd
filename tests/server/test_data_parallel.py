"""Data parallelism: two engine-core processes behind one API server. Requests complete with the
text one engine gives; requests that share a prefix land on the replica that caches it (hits
counted per engine in /metrics); a replica that dies fails its own requests, the other serves
on; a killed server takes both cores with it, and they remove the sockets' folder."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest

from octavo.config import EngineArgs
from octavo.engine.core_client import AsyncMPEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import make_server
from octavo.worker.device import split_cpus

from .conftest import API_KEY, MAX_MODEL_LEN, PACKED_MAX_ROWS, RunningServer
from .utils import free_port, start_in_thread, start_serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_server() -> Iterator[RunningServer]:
    # The session server's settings (the same tokens for the same prompt), two replicas.
    async_engine = AsyncMPEngine.from_engine_args(
        EngineArgs(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_tokens=4096,
            max_num_seqs=64,
            block_size=16,
            seed=0,
            packed_max_rows=PACKED_MAX_ROWS,
            data_parallel_size=2,
        )
    )
    config = ServerConfig(host="127.0.0.1", port=free_port(), api_key=API_KEY, shutdown_timeout_s=5)
    app = make_server_app(async_engine, config)
    uv = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(uv, "dp-server", 60)
    yield RunningServer(f"http://127.0.0.1:{config.port}", API_KEY, async_engine, app)
    uv.should_exit = True
    thread.join(30)


def _complete(server: RunningServer, prompt: str, max_tokens: int = 12) -> str:
    model = server.async_engine.engine.config.served_model_name
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(
        server.base_url + "/v1/completions", json=body, headers=server.headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _metric(server: RunningServer, name: str, engine: str) -> float:
    text = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=30).text
    pattern = rf'^{re.escape(name)}\{{engine="{engine}",model_name="[^"]*"\}} (\S+)$'
    values = re.findall(pattern, text, re.MULTILINE)
    assert len(values) == 1, [line for line in text.splitlines() if line.startswith(name)]
    return float(values[0])


def test_the_cpus_are_split_between_the_replicas() -> None:
    shares = split_cpus(2)
    assert all(shares) and sorted(cpu for share in shares for cpu in share) == sorted(
        psutil.Process().cpu_affinity()
    )
    assert split_cpus(1) == [None]


def test_requests_complete_on_both_replicas_with_one_engines_text(
    dp_server: RunningServer, server: RunningServer
) -> None:
    # Prompts no test sends elsewhere: no prefix-cache hit on either server. One at a time
    # on both: a quantized model's kernels depend on how many rows a step has, so only the
    # same batches give the same tokens; equally loaded, the replicas take turns.
    prompts = [f"Data parallel check {i}: the capital of country {i} is" for i in range(4)]
    texts = [_complete(dp_server, p) for p in prompts]
    assert texts == [_complete(server, p) for p in prompts]
    done = [_metric(dp_server, "vllm:generation_tokens_total", e) for e in ("0", "1")]
    assert all(count >= 2 * 12 for count in done), done
    # And at once: every request completes.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: _complete(dp_server, p + " and"), prompts * 2))
    assert all(texts)
    dp_server.async_engine.engine.check_integrity()


def test_requests_sharing_a_prefix_land_on_the_replica_that_caches_it(
    dp_server: RunningServer,
) -> None:
    engine = dp_server.async_engine.engine
    prefixes = [
        " ".join(f"{word}{i}" for i in range(40)) for word in ("alpha", "omega")
    ]  # several 16-token blocks each
    hits = [_metric(dp_server, "vllm:prefix_cache_hits_total", e) for e in ("0", "1")]
    # Alternate the two prefixes, one request at a time (the replicas equally loaded).
    for suffix in (" first", " second", " third"):
        for prefix in prefixes:
            _complete(dp_server, prefix + suffix, max_tokens=2)
    gained = [
        _metric(dp_server, "vllm:prefix_cache_hits_total", e) - hits[i]
        for i, e in enumerate(("0", "1"))
    ]
    # Each prefix went to one replica and every repeat hit it there: two repeats of a prefix
    # of at least three full blocks on each replica.
    prefix_blocks = [
        len(engine.tokenizer(p).input_ids) // engine.config.cache.block_size for p in prefixes
    ]
    assert min(prefix_blocks) >= 3
    assert all(g >= 2 * 3 * engine.config.cache.block_size for g in gained), gained


def test_a_dead_replica_fails_its_own_requests_and_the_other_serves_on(
    dp_server: RunningServer,
) -> None:
    engine = dp_server.async_engine.engine
    model = engine.config.served_model_name
    body = {"model": model, "prompt": "Count on", "max_tokens": 300, "ignore_eos": True}
    # The stream is the only request in flight: kill the replica that runs it.
    with httpx.Client(base_url=dp_server.base_url, headers=dp_server.headers) as client:
        lines = []

        def kill_its_replica() -> None:
            (request_replica,) = set(dp_server.async_engine._replica_of.values())
            engine.cores[request_replica].process.kill()

        with client.stream(
            "POST", "/v1/completions", json=dict(body, stream=True), timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        kill_its_replica()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "is not running" in error["message"], error
    # The other replica serves; the server stays healthy.
    assert _complete(dp_server, "Still serving?", max_tokens=4)
    assert httpx.get(dp_server.base_url + "/health", timeout=10).status_code == 200
    assert len(engine.live_replicas()) == 1
    engine.check_integrity()


def test_a_killed_server_takes_every_engine_core_with_it() -> None:
    port = free_port()
    server = start_serve(port, "--data-parallel-size", "2")
    try:
        children = psutil.Process(server.pid).children(recursive=True)
        cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(cores) == 2, [c.cmdline() for c in children]
        text = httpx.get(
            f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer k"}, timeout=30
        ).text
        assert 'vllm:num_requests_running{engine="1",model_name="tiny"}' in text
        # The sockets' folder: where each core bound its input socket.
        (socket_dir,) = {
            os.path.dirname(c.laddr)
            for core in cores
            for c in core.net_connections("unix")
            if os.path.basename(c.laddr or "").startswith("input-")
        }
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        _, alive = psutil.wait_procs(cores, timeout=10)
        assert not alive, alive
        assert not os.path.exists(socket_dir)
    finally:
        if server.poll() is None:
            server.kill()
