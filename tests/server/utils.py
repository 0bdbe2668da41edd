"""Checks the server tests share."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from octavo.entrypoints.server.http_server import Server


def free_port() -> int:
    """A local TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(port: int, *extra: str, uds: str | None = None) -> subprocess.Popen:
    """`octavo serve` over the embedded model (float32, a small pool, API key "k", served as
    "tiny") in a subprocess, returned once /health answers 200; `extra` are more flags. With
    `uds` it serves on that Unix domain socket (--uds) instead of the port."""
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
        *(["--uds", uds] if uds is not None else []),
        *extra,
    ]
    return start_server_process(command, port, uds)


def start_server_process(command: list[str], port: int, uds: str | None = None) -> subprocess.Popen:
    """Run `command` (a server on 127.0.0.1:`port`, or on the Unix domain socket `uds`) and
    return it once /health answers 200; fails with the end of its stderr if it exits first."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    transport = httpx.HTTPTransport(uds=uds) if uds is not None else None
    url = "http://localhost/health" if uds is not None else f"http://127.0.0.1:{port}/health"
    with httpx.Client(transport=transport, timeout=1) as client:
        while True:
            if process.poll() is not None:
                raise AssertionError(process.stderr.read().decode()[-2000:])
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if client.get(url).status_code == 200:
                    return process
            except httpx.HTTPError:
                time.sleep(0.25)


def stream_events(base_url: str, body: dict, after_two: Callable[[], object]) -> list[str]:
    """Stream a completion from a `start_serve` server; call `after_two()` once the second
    `data:` event has arrived, and return every `data:` line of the stream."""
    lines: list[str] = []
    with httpx.stream(
        "POST",
        base_url + "/v1/completions",
        json=dict(body, stream=True),
        timeout=60,
        headers={"Authorization": "Bearer k"},
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if len(lines) == 2:
                after_two()
    return lines


def start_in_thread(server: Server, name: str, timeout_s: float) -> threading.Thread:
    """Run `server` in a daemon thread and return it once the server listens; fails if the
    thread dies or `timeout_s` passes first."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return thread


def assert_error(
    response: httpx.Response, param: str | None, fragment: str, status: int = 400
) -> None:
    """An OpenAI error object with this status and param, its message holding `fragment`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert fragment in error["message"], error["message"]
