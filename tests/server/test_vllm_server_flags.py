"""The server settings of vLLM's flags, with their effect over HTTP: several API keys, several
served model names, FastAPI's docs, the root path, CORS details, the request's `priority`
under each scheduling policy, and the flags' parsing into ServerConfig."""

from __future__ import annotations

import httpx

from octavo.entrypoints.cli import make_parser, server_config_from
from octavo.entrypoints.server.app import ServerConfig

from .mock_server import mock_server
from .utils import assert_error


def test_any_of_several_api_keys_is_accepted():
    with (
        mock_server(ServerConfig(api_key=("first", "second"))) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        for key, status in (("first", 200), ("second", 200), ("third", 401), ("firs", 401)):
            response = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status, key


def test_several_served_model_names_are_listed_and_each_is_accepted():
    with (
        mock_server(served_model_names=("main", "alias")) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        models = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in models] == ["main", "alias"]
        for name in ("main", "alias"):
            body = {"model": name, "prompt": "a b", "max_tokens": 2}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "main"
        response = client.post("/v1/completions", json={"model": "other", "prompt": "a"})
        assert response.status_code == 404
        assert response.json()["error"]["param"] == "model"


def test_fastapi_docs_are_served_unless_disabled():
    for disabled, status in ((False, 200), (True, 404)):
        config = ServerConfig(disable_fastapi_docs=disabled, root_path="/api")
        with (
            mock_server(config) as running,
            httpx.Client(base_url=running.base_url, timeout=30) as client,
        ):
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert client.get(path).status_code == status, path
            if not disabled:
                schema = client.get("/openapi.json").json()
                assert "/v1/chat/completions" in schema["paths"]
                assert schema["servers"] == [{"url": "/api"}]  # behind the proxy's prefix


def test_cors_methods_headers_and_credentials():
    config = ServerConfig(
        allowed_origins=("https://app.example",),
        allowed_methods=("GET", "POST"),
        allowed_headers=("X-Custom",),
        allow_credentials=True,
    )
    with (
        mock_server(config) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        response = client.options(
            "/v1/models",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "X-Custom",
            },
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-methods"] == "GET, POST"
        assert "X-Custom" in response.headers["access-control-allow-headers"]
        assert response.headers["access-control-allow-credentials"] == "true"


def test_server_flags_parse_into_the_server_config():
    ns = make_parser().parse_args(
        [
            "serve",
            *("--api-key", "k1", "k2", "--allowed-origins", '["*"]'),
            *(
                "--allowed-methods",
                '["GET"]',
                "--allowed-headers",
                "X-A,X-B",
                "--allow-credentials",
            ),
            *("--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"),
            *("--root-path", "/api", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"),
            *("--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--disable-fastapi-docs"),
            *("--response-role", "bot", "--enable-force-include-usage"),
            "--enable-request-id-headers",
            *("--uds", "/run/octavo.sock"),
        ]
    )
    config = server_config_from(ns)
    assert config.uds == "/run/octavo.sock"
    assert server_config_from(make_parser().parse_args(["serve"])).uds is None
    assert config.api_key == ("k1", "k2")
    assert (config.allowed_origins, config.allowed_methods) == (("*",), ("GET",))
    assert config.allowed_headers == ("X-A", "X-B") and config.allow_credentials
    assert (config.uvicorn_log_level, config.disable_uvicorn_access_log) == ("warning", True)
    assert (config.root_path, config.ssl_keyfile, config.ssl_certfile) == ("/api", "k.pem", "c.pem")
    assert (config.response_role, config.enable_force_include_usage) == ("bot", True)
    assert config.enable_request_id_headers
    assert (config.ssl_ca_certs, config.ssl_cert_reqs, config.disable_fastapi_docs) == (
        "ca.pem",
        2,
        True,
    )


def test_priority_is_taken_under_the_priority_policy_and_refused_under_fcfs():
    """vLLM's `priority` extra on both endpoints: 0 always passes; any other value runs under
    --scheduling-policy priority and is a 400 naming `priority` under fcfs (vLLM's answer, not
    a silent fcfs)."""
    bodies = {
        "/v1/completions": {"prompt": "a b", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    }
    for policy in ("fcfs", "priority"):
        with (
            mock_server(scheduler={"scheduling_policy": policy}) as running,
            httpx.Client(base_url=running.base_url, timeout=30) as client,
        ):
            for path, body in bodies.items():
                assert client.post(path, json={**body, "priority": 0}).status_code == 200
                response = client.post(path, json={**body, "priority": 3})
                if policy == "priority":
                    assert response.status_code == 200, response.text
                else:
                    assert_error(response, "priority", "Priority scheduling is not enabled")
                response = client.post(path, json={**body, "priority": "high"})
                assert_error(response, "priority", "integer")


def test_the_chat_role_chunk_goes_out_with_the_first_token(monkeypatch):
    """A client's time to the first chat chunk is its time to the first token (vLLM sends the
    role delta then), not the moment the request is accepted: with the mock model taking 0.3 s
    a step, the role chunk and the first token's chunk arrive together, not a step apart."""
    import json
    import time

    from .mock_server import SlowMockRunner

    monkeypatch.setattr(SlowMockRunner, "step_s", 0.3)
    with (
        mock_server(slow=True) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        body = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3, "stream": True}
        arrivals = []
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic(), json.loads(line[len("data: ") :])))
        (role_at, role), (token_at, token) = arrivals[:2]
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert token["choices"][0]["delta"].get("content")
        assert token_at - role_at < 0.15


def test_sagemaker_routes_and_lora_routes():
    with (
        mock_server(ServerConfig(api_key="k")) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        assert client.get("/ping").status_code == 200  # no key needed, as /health
        assert client.post("/ping").status_code == 200
        auth = {"Authorization": "Bearer k"}
        chat = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}
        response = client.post("/invocations", json=chat, headers=auth)
        assert response.status_code == 200 and response.json()["object"] == "chat.completion"
        completion = {"prompt": "a b", "max_tokens": 2}
        response = client.post("/invocations", json=completion, headers=auth)
        assert response.status_code == 200 and response.json()["object"] == "text_completion"
        response = client.post("/invocations", json={"input": "x"}, headers=auth)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        bad = {"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}
        response = client.post("/invocations", json=bad, headers=auth)
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        streamed = client.post("/invocations", json={**completion, "stream": True}, headers=auth)
        assert streamed.text.rstrip().endswith("data: [DONE]")
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = client.post(path, json={"lora_name": "x", "lora_path": "y"}, headers=auth)
            assert response.status_code == 404 and "LoRA" in response.json()["error"]["message"]


def test_max_logprobs_caps_what_a_request_may_ask_for():
    with (
        mock_server(max_logprobs=2) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        body = {"prompt": "a b", "max_tokens": 2}
        assert client.post("/v1/completions", json={**body, "logprobs": 2}).status_code == 200
        response = client.post("/v1/completions", json={**body, "logprobs": 3})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "logprobs" and "--max-logprobs" in error["message"]
        chat = {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 3}
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_response_role_forced_usage_and_request_id_headers():
    config = ServerConfig(
        response_role="bot", enable_force_include_usage=True, enable_request_id_headers=True
    )
    with (
        mock_server(config) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}
        response = client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "r1"})
        assert response.json()["choices"][0]["message"]["role"] == "bot"
        assert response.headers["x-request-id"] == "r1"
        assert len(client.get("/v1/models").headers["x-request-id"]) == 32  # a new one
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}).text
        events = [
            line[len("data: ") :] for line in streamed.splitlines() if line.startswith("data: {")
        ]
        assert '"role":"bot"' in events[0]
        assert '"usage":{"prompt_tokens"' in events[-1]  # without stream_options
        completion = {"prompt": "a b", "max_tokens": 2, "stream": True}
        streamed = client.post("/v1/completions", json=completion).text
        events = [line for line in streamed.splitlines() if line.startswith("data: {")]
        assert '"usage":{"prompt_tokens"' in events[-1]
    with (
        mock_server() as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        response = client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert '"usage":{' not in response.text and "x-request-id" not in response.headers
