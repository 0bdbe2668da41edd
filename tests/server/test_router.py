"""`octavo router` in front of servers: a request follows its prompt's prefix to one backend,
others spread by load; a backend that cannot be reached gets nothing (the request goes to the
next one, never lost), one that fails its health check gets nothing until it passes again;
bodies and server-sent events pass through unchanged, with the client's headers; and the
session's real server answers the openai client through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from octavo.entrypoints.router import RouterConfig, build_router_app, prompt_text, text_keys

from .conftest import RunningServer
from .utils import free_port, start_in_thread


class FakeBackend:
    """An OpenAI-shaped server that records what reached it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[dict] = []
        self.headers: list[dict] = []
        self.healthy = True
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.received.append(body)
            self.headers.append(dict(request.headers))
            if body.get("stream"):

                async def events():
                    for i in range(3):
                        yield f"data: {self.name}-{i}\n\n"
                        await asyncio.sleep(0.05)
                    yield "data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse({"backend": self.name}, headers={"x-backend": self.name})

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = start_in_thread(self.server, f"fake-{name}", 30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_router(backends: list[str], interval_s: float = 0.2) -> tuple[str, uvicorn.Server]:
    config = RouterConfig(tuple(backends), health_check_interval_s=interval_s)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_router_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    start_in_thread(server, "router", 30)
    return f"http://127.0.0.1:{port}", server


@pytest.fixture
def fakes() -> Iterator[list[FakeBackend]]:
    backends = [FakeBackend("a"), FakeBackend("b")]
    yield backends
    for backend in backends:
        backend.stop()


def test_prefix_keys_follow_the_prompt_text() -> None:
    shared = "x" * 200
    first, second = text_keys(shared + "one" * 30), text_keys(shared + "two" * 30)
    assert first[:3] == second[:3] and first[3] != second[3]
    assert text_keys("short") == []
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prompt_text("/v1/chat/completions", chat) == "system\nS\nuser\nU\n"
    assert prompt_text("/v1/completions", {"prompt": ["P"]}) == "P"
    assert prompt_text("/v1/completions", {"prompt": [1, 2]}) == "[1, 2]"
    assert prompt_text("/v1/models", None) == ""


def test_requests_follow_their_prefix_and_pass_through(fakes: list[FakeBackend]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: down from the start
    gone = FakeBackend("gone")  # up at the first check, then gone: a request finds it closed
    base_url, router = start_router([gone.url, fakes[0].url, fakes[1].url, dead], 60.0)
    gone.stop()
    try:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            prefixes = ["The first document. " * 20, "Another text entirely. " * 20]
            for round_ in range(3):
                for prefix in prefixes:
                    response = client.post(
                        "/v1/completions",
                        json={"prompt": prefix + f"question {round_}"},
                        headers={"Authorization": "Bearer secret"},
                    )
                    assert response.status_code == 200, response.text
            # Each prefix stayed on one backend, and they did not share one.
            owners = {
                prefix: {
                    f.name for f in fakes if any(r["prompt"].startswith(prefix) for r in f.received)
                }
                for prefix in prefixes
            }
            assert all(len(names) == 1 for names in owners.values()), owners
            assert owners[prefixes[0]] != owners[prefixes[1]]
            # Nothing was lost to the dead backend; its header and the response's came through.
            assert sum(len(f.received) for f in fakes) == 6
            assert all(h["authorization"] == "Bearer secret" for f in fakes for h in f.headers)
            assert response.headers["x-backend"] in ("a", "b")
            # Server-sent events arrive as the backend sends them.
            with client.stream(
                "POST", "/v1/completions", json={"prompt": "s", "stream": True}
            ) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and len(lines) == 4
            assert lines[0].endswith("-0") and lines[2].endswith("-2")
            metrics = client.get("/metrics").text
            assert f'octavo:router_backend_up{{backend="{dead}"}} 0.0' in metrics
            assert "octavo:router_retries_total 1.0" in metrics
    finally:
        router.should_exit = True


def test_a_backend_failing_its_health_check_gets_nothing_until_it_passes(
    fakes: list[FakeBackend],
) -> None:
    base_url, router = start_router([f.url for f in fakes])
    try:
        fakes[0].healthy = False
        time.sleep(1.0)  # a few checks
        with httpx.Client(base_url=base_url, timeout=30) as client:
            for i in range(4):
                assert client.post("/v1/completions", json={"prompt": f"p{i}"}).status_code == 200
            assert not fakes[0].received and len(fakes[1].received) == 4
            fakes[1].healthy = False
            time.sleep(1.0)
            assert client.get("/health").status_code == 503
            response = client.post("/v1/completions", json={"prompt": "p"})
            assert (
                response.status_code == 503 and "No backend" in response.json()["error"]["message"]
            )
            fakes[0].healthy = True
            time.sleep(1.0)
            assert client.get("/health").status_code == 200
            assert client.post("/v1/completions", json={"prompt": "p"}).status_code == 200
            assert len(fakes[0].received) == 1
    finally:
        router.should_exit = True


def test_the_openai_client_through_the_router(server: RunningServer) -> None:
    base_url, router = start_router([server.base_url])
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=server.api_key)
        model = client.models.list().data[0].id
        direct = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key)
        prompt = "Routing check: one, two,"
        text = (
            client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            .choices[0]
            .text
        )
        assert (
            text
            == direct.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            .choices[0]
            .text
        )
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            stream=True,
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        # The backend's own errors come through as they are.
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
    finally:
        router.should_exit = True


def test_a_router_needs_backends_given_as_urls() -> None:
    with pytest.raises(ValueError, match="at least one"):
        RouterConfig(())
    with pytest.raises(ValueError, match="http"):
        RouterConfig(("localhost:8000",))
