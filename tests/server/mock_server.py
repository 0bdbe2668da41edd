"""An octavo server over the mock model (tests/mock_engine.py), for tests of the HTTP layer that
need no real model: limits, admin endpoints, shutdown, fuzzing. Started in milliseconds, on its
own port and thread, with the server's real HTTP stack (make_server: uvicorn and its limits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from octavo import LLM
from octavo.core.mock_runner import MockRunner
from octavo.engine.async_engine import AsyncEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import Server, make_server

from ..mock_engine import mock_llm
from .utils import free_port, start_in_thread


class SlowMockRunner(MockRunner):
    """The mock model taking `step_s` per step, so that a request can still be running when
    a test wants it to (a stream at shutdown, say)."""

    step_s = 0.05

    def execute(self, out):
        time.sleep(self.step_s)
        return super().execute(out)


class GatedMockRunner(MockRunner):
    """The mock model, whose steps wait for the test to open `gate` (a fresh Event per test):
    requests submitted meanwhile stay where they are, their prompts not yet prefilled."""

    gate = threading.Event()

    def execute(self, out):
        assert self.gate.wait(30), "the test never opened the gate"
        return super().execute(out)


@dataclass
class MockServer:
    base_url: str
    server: Server
    async_engine: AsyncEngine
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextmanager
def mock_server(
    config: ServerConfig | None = None,
    slow: bool = False,
    served_model_names: tuple[str, ...] = (),
    scheduler: dict[str, object] | None = None,
    llm: LLM | None = None,
    **engine_config: object,
) -> Iterator[MockServer]:
    """A running server over a fresh mock engine (max_model_len 128; named "mock", or each of
    `served_model_names`; SchedulerConfig fields from `scheduler`, other EngineConfig fields
    from `engine_config`), or over `llm`'s engine when given; stopped on exit."""
    llm = llm or mock_llm(max_model_len=128, **(scheduler or {}))
    engine = llm.llm_engine
    if served_model_names:
        engine_config.update(
            served_model_name=served_model_names[0], served_model_names=served_model_names
        )
    engine.config = replace(engine.config, **engine_config)
    if slow:
        engine.model_runner.__class__ = SlowMockRunner
    config = replace(config or ServerConfig(), host="127.0.0.1", port=free_port())
    app = make_server_app(engine, config)
    async_engine = app.state.async_engine
    server = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(server, "mock-server", 30)
    running = MockServer(f"http://127.0.0.1:{config.port}", server, async_engine, thread)
    try:
        yield running
    finally:
        running.stop()
