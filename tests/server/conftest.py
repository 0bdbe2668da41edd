"""One octavo server for the whole `tests/server` session, laid out as `octavo serve` runs:
uvicorn in a thread on a free 127.0.0.1 port, the engine core in a process of its own, over the
embedded model in float32 with a modest KV pool and an API key.

Loading the model takes seconds, so every module shares this server. Tests reach the engine only
through the AsyncEngine (`call` runs a function on the frontend engine, MPEngine, whose
utility calls run in the core process between its steps).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from octavo.config import EngineArgs
from octavo.engine.core_client import AsyncMPEngine, MPEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import make_server

from .utils import free_port, start_in_thread

API_KEY = "test-key"
# A fixed row limit for the matmul kernels instead of the start-up timing: the quantized
# model's paths round differently (8-bit or bfloat16 activations), and a process timed with
# fewer CPUs (a data-parallel replica) could pick another path for the same rows, so that the
# same prompt would not give the same tokens.
PACKED_MAX_ROWS = 16
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 1 << 20
# Short, so that the tests of the read timeouts take seconds.
HEADER_READ_TIMEOUT_S = 2.0
BODY_READ_TIMEOUT_S = 2.0


@dataclass
class RunningServer:
    base_url: str
    api_key: str
    async_engine: AsyncMPEngine
    app: Any
    # Where the engine core's profiler writes its traces.
    trace_dir: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def call(self, fn: Callable[[MPEngine], Any], timeout_s: float = 60.0) -> Any:
        """Run `fn(engine)` (the frontend engine) and return its result."""
        loop = self.async_engine.loop
        assert loop is not None
        future = asyncio.run_coroutine_threadsafe(self.async_engine.call(fn), loop)
        return future.result(timeout_s)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until no request is left in the engine (aborts finish on the next step)."""
        deadline = time.monotonic() + timeout_s
        while self.call(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "the engine did not become idle"
            time.sleep(0.05)

    def assert_no_leak(self) -> None:
        """Idle engine: no request anywhere, every KV block free, queues consistent."""
        self.wait_idle()

        def check(engine: MPEngine) -> tuple[int, int, int, int]:
            engine.check_integrity()
            stats = engine.make_stats()
            return (
                stats.num_running_reqs,
                stats.num_waiting_reqs,
                stats.num_free_blocks,
                stats.num_blocks,
            )

        running, waiting, free, total = self.call(check)
        assert (running, waiting) == (0, 0)
        assert free == total, f"{total - free} KV blocks leaked"


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    trace_dir = tempfile.mkdtemp(prefix="octavo-traces-")
    async_engine = AsyncMPEngine.from_engine_args(
        # 16-token blocks (the CPU default is 128): short prompts then hit the prefix cache.
        EngineArgs(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_tokens=16384,
            max_num_seqs=64,
            block_size=16,
            seed=0,
            packed_max_rows=PACKED_MAX_ROWS,
            enable_sleep_mode=True,
            # vllm:kv_block_* (the KV cache dashboard reads them) are exported with it.
            kv_cache_metrics=True,
            profiler_config={"profiler": "torch", "torch_profiler_dir": trace_dir},
        )
    )
    config = ServerConfig(
        host="127.0.0.1",
        port=free_port(),
        api_key=API_KEY,
        max_request_body_bytes=MAX_BODY_BYTES,
        enable_dev_endpoints=True,
        shutdown_timeout_s=5,
        header_read_timeout_s=HEADER_READ_TIMEOUT_S,
        body_read_timeout_s=BODY_READ_TIMEOUT_S,
    )
    app = make_server_app(async_engine, config)
    uv = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(uv, "test-server", 60)
    yield RunningServer(
        f"http://127.0.0.1:{config.port}", API_KEY, app.state.async_engine, app, trace_dir
    )
    uv.should_exit = True
    thread.join(30)
    shutil.rmtree(trace_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client
