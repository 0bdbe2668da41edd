"""`octavo router`: one OpenAI-compatible address in front of several servers (`octavo serve`
on other machines, or any server with the same API), so that scale-out across machines needs
nothing else.

Each request goes to one backend by the policy the API server uses for its own data-parallel
engines (octavo/core/router.py): the backend thought to hold the longest cached prefix of the
prompt, unless it is too loaded, else the least loaded one. The router does not tokenize: its
prefix keys are chained hashes of the prompt's text in chunks of `CHUNK_CHARS` characters (for
chat, the messages as the router sees them), which share a prefix exactly where the prompts do.
Load is the number of requests in flight to each backend, counted here.

- Health: every `health_check_interval_s` each backend's /health is asked; a backend that does
  not answer 200 gets no requests until it does again.
- Retries: a request that never reached its backend (the connection was refused or timed out)
  goes to the next best one, and that backend counts as down until its next good check. A
  request that reached its backend is never sent twice: what the backend answers, an error
  included, goes to the client.
- Passthrough: the method, path, query, body and headers go unchanged (the Authorization
  header too: the backends check their keys); the response streams back chunk by chunk as it
  comes (server-sent events are not buffered). A client that disconnects closes the backend's
  connection, which aborts the request there.
- /health answers 200 while a backend is up; /metrics has the router's own series.

Must not: import the engine or torch (a router machine needs no model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from octavo.core.router import PrefixRouter

logger = logging.getLogger(__name__)

# Characters per prefix key: about a 16-token block of English text.
CHUNK_CHARS = 64
# Keys remembered per backend (CHUNK_CHARS each): some 4 MB of prompt text.
CAPACITY_CHUNKS = 65536
# Headers that belong to one connection, not to the request or response they carry.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    health_check_interval_s: float = 5.0
    # Longest wait for a backend's next bytes (a long prefill is a wait before the first).
    read_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("octavo router needs at least one --backend URL.")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--backend {url!r}: give an http:// or https:// URL.")


def prompt_text(path: str, body: Any) -> str:
    """The part of a request body that a backend's prefix cache keys on, as text: a
    completion's prompt, a chat's messages (role and content), "" for anything else."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if not isinstance(content, str):
                    content = json.dumps(content, sort_keys=True)
                parts.append(f"{message.get('role')}\n{content}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list):  # token ids, or several prompts: their JSON
        return json.dumps(prompt)
    return ""


def text_keys(text: str, chunk_chars: int = CHUNK_CHARS) -> list[int]:
    """Chained keys of the full chunks of `text`: key i stands for text[: (i + 1) * chunk]."""
    keys: list[int] = []
    parent = 0
    for begin in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hash((parent, text[begin : begin + chunk_chars]))
        keys.append(parent)
    return keys


class Backends:
    """The backends, their health and the routing policy over them."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.policy = PrefixRouter(len(self.urls), CAPACITY_CHUNKS)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "octavo:router_requests",
            "Requests sent to each backend (retries included).",
            ["backend"],
            registry=self.registry,
        )
        self.retries = Counter(
            "octavo:router_retries",
            "Requests sent to another backend because theirs could not be reached.",
            registry=self.registry,
        )
        self.up = Gauge(
            "octavo:router_backend_up",
            "1 while the backend passes its health checks.",
            ["backend"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "octavo:router_requests_in_flight",
            "Requests sent to the backend and not yet answered in full.",
            ["backend"],
            registry=self.registry,
        )
        for url in self.urls:
            self.up.labels(url).set(1)
            self.in_flight.labels(url)
            self.requests.labels(url)

    def take(self, keys: Sequence[int], tried: set[int]) -> int | None:
        """The backend for a request, counted in flight; None if none is left."""
        try:
            index = self.policy.route(keys, exclude=tried)
        except ValueError:
            return None
        self.requests.labels(self.urls[index]).inc()
        self.in_flight.labels(self.urls[index]).inc()
        return index

    def release(self, index: int) -> None:
        self.policy.finished(index)
        self.in_flight.labels(self.urls[index]).dec()

    def set_health(self, index: int, healthy: bool) -> None:
        if healthy and not self.policy.live[index]:
            logger.info("backend %s is up", self.urls[index])
            self.policy.mark_live(index)
        elif not healthy and self.policy.live[index]:
            logger.warning("backend %s is down", self.urls[index])
            self.policy.mark_dead(index)
        self.up.labels(self.urls[index]).set(1 if healthy else 0)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        async def check(index: int) -> None:
            try:
                response = await client.get(self.urls[index] + "/health", timeout=5.0)
                healthy = response.status_code == 200
            except httpx.HTTPError:
                healthy = False
            self.set_health(index, healthy)

        await asyncio.gather(*(check(i) for i in range(len(self.urls))))


def build_router_app(config: RouterConfig) -> FastAPI:
    backends = Backends(config.backends)
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["client"] = client
            await backends.check_all(client)

            async def watch() -> None:
                while True:
                    await asyncio.sleep(config.health_check_interval_s)
                    await backends.check_all(client)

            task = asyncio.create_task(watch())
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="octavo router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.backends = backends

    @app.get("/health")
    async def health() -> Response:
        up = any(backends.policy.live)
        return Response(status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(backends.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the backend says what is wrong with it
        keys = text_keys(prompt_text(request.url.path, parsed))
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        client: httpx.AsyncClient = state["client"]
        tried: set[int] = set()
        while True:
            index = backends.take(keys, tried)
            if index is None:
                return _error(503, "No backend is available: every one is down.")
            url = backends.urls[index] + request.url.path
            upstream_request = client.build_request(
                request.method, url, params=request.url.query, headers=headers, content=body
            )
            try:
                upstream = await client.send(upstream_request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Never reached it: the next best backend gets the request.
                logger.warning("backend %s unreachable (%s); retrying", backends.urls[index], exc)
                backends.release(index)
                backends.set_health(index, False)
                backends.retries.inc()
                tried.add(index)
                continue
            except httpx.HTTPError as exc:
                backends.release(index)
                return _error(502, f"The backend failed: {exc!r}")
            return StreamingResponse(
                _relay(upstream, backends, index),
                status_code=upstream.status_code,
                headers={
                    name: value
                    for name, value in upstream.headers.items()
                    if name.lower() not in HOP_BY_HOP
                },
            )

    return app


def _error(status: int, message: str) -> JSONResponse:
    """The router's own errors, in OpenAI's format (server.errors' would load the server)."""
    body = {"message": message, "type": "server_error", "param": None, "code": None}
    return JSONResponse({"error": body}, status_code=status)


async def _relay(upstream: httpx.Response, backends: Backends, index: int) -> AsyncIterator[bytes]:
    """The backend's body as it comes; on the end, an error or a client gone, the backend's
    connection is closed and the request no longer counts in flight."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("backend %s broke off a response: %r", backends.urls[index], exc)
    finally:
        await upstream.aclose()
        backends.release(index)


def run_router(ns: Any) -> int:
    import uvicorn

    config = RouterConfig(
        backends=tuple(ns.backend),
        host=ns.host,
        port=ns.port,
        health_check_interval_s=ns.health_check_interval,
        read_timeout_s=ns.read_timeout,
    )
    logger.info("routing to %s", ", ".join(config.backends))
    uvicorn.run(build_router_app(config), host=config.host, port=config.port, log_level="info")
    return 0
