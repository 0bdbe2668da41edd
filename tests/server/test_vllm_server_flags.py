"""The server settings of vLLM's flags, with their effect over HTTP: several API keys, several
served model names, FastAPI's docs, the root path, CORS details, default chat template
kwargs, logprob tokens as token ids, the generation config's sampling defaults, the request's
`priority` under each scheduling policy, a request's own chat template, tools left out under
tool_choice none, /tokenizer_info, access logs per endpoint, and the flags' parsing into
ServerConfig."""

from __future__ import annotations

import logging
import re

import httpx

from octavo.entrypoints.cli import make_parser, server_config_from
from octavo.entrypoints.server.app import ServerConfig
from octavo.entrypoints.server.http_server import ACCESS_LOGGER, AccessLogFilter

from ..mock_engine import VOCAB, mock_llm
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
            *("--default-chat-template-kwargs", '{"enable_thinking": false}'),
            "--return-tokens-as-token-ids",
            *("--uds", "/run/octavo.sock"),
            "--trust-request-chat-template",
            "--enable-tokenizer-info-endpoint",
            "--exclude-tools-when-tool-choice-none",
            *("--disable-access-log-for-endpoints", "/health, /metrics"),
        ]
    )
    config = server_config_from(ns)
    assert config.trust_request_chat_template and config.enable_tokenizer_info_endpoint
    assert config.tool_serving.exclude_tools_when_tool_choice_none
    assert config.disable_access_log_for_endpoints == ("/health", "/metrics")
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.return_tokens_as_token_ids
    defaults = server_config_from(make_parser().parse_args(["serve"]))
    assert not (defaults.trust_request_chat_template or defaults.enable_tokenizer_info_endpoint)
    assert not defaults.exclude_tools_when_tool_choice_none
    assert defaults.disable_access_log_for_endpoints == ()
    assert defaults.default_chat_template_kwargs is None
    assert not defaults.return_tokens_as_token_ids
    assert config.uds == "/run/octavo.sock" and defaults.uds is None
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


def _token_ids(text: str) -> list[int]:
    from ..mock_engine import VOCAB

    return [VOCAB.index(word) for word in text.split()]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id():
    """vLLM's `token_id:ID`: completions' tokens and top_logprobs keys, chat's token and
    top_logprobs[].token, and `bytes` those of that name."""
    named = re.compile(r"token_id:\d+")
    with (
        mock_server(ServerConfig(return_tokens_as_token_ids=True)) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        body = {"prompt": "a b", "max_tokens": 3, "logprobs": 2, "temperature": 0}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        ids = _token_ids(choice["text"])
        assert len(ids) == 3
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{i}" for i in ids]
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
            assert token in top and all(named.fullmatch(key) for key in top)
        # Offsets are still those of the text.
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][1] > 0
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
        assert '"tokens":["token_id:' in streamed

        chat = {
            "messages": [{"role": "user", "content": "a b"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        choice = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
        content = choice["logprobs"]["content"]
        ids = _token_ids(choice["message"]["content"])
        assert [entry["token"] for entry in content] == [f"token_id:{i}" for i in ids]
        for entry in content:
            assert entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 2
            for top in entry["top_logprobs"]:
                assert named.fullmatch(top["token"]) and top["bytes"] == list(top["token"].encode())
    with (
        mock_server() as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        # Without the flag, the tokens are the text's pieces (the mock's carry no spaces).
        assert "".join(choice["logprobs"]["tokens"]) == "".join(choice["text"].split())


def test_default_chat_template_kwargs_reach_the_template_under_the_requests_own():
    template = "{{ greeting }} {% for m in messages %}{{ m['content'] }} {% endfor %}{{ tail }}"
    config = ServerConfig(default_chat_template_kwargs={"greeting": "dog", "tail": "one"})
    with (
        mock_server(config) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        running.async_engine.engine.tokenizer.chat_template = template
        messages = [{"role": "user", "content": "cat"}]
        tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert tokens == _token_ids("dog cat one")
        own = {"messages": messages, "chat_template_kwargs": {"greeting": "the"}}
        tokens = client.post("/tokenize", json=own).json()["tokens"]
        assert tokens == _token_ids("the cat one")  # the request's key wins, the rest stays
        chat = {**own, "max_tokens": 1}
        usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens"] == 3


def test_generation_defaults_fill_the_fields_a_request_leaves_unset():
    """The generation config's defaults (EngineConfig.sampling_defaults) apply where a request
    sets nothing; its own fields win; the default max_tokens is cut to the prompt's room."""
    chat = {"messages": [{"role": "user", "content": "a b"}], "seed": 7}
    with (
        mock_server(sampling_defaults={"temperature": 0.0, "max_tokens": 4}) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        greedy = client.post("/v1/chat/completions", json={**chat, "temperature": 0}).json()
        assert greedy["usage"]["completion_tokens"] == 4
        response = client.post("/v1/chat/completions", json=chat).json()
        assert response["choices"][0]["message"] == greedy["choices"][0]["message"]
        sampled = client.post("/v1/chat/completions", json={**chat, "temperature": 1.0}).json()
        # Seed 7 draws other words than the greedy script (the mock's rule).
        assert sampled["choices"][0]["message"] != greedy["choices"][0]["message"]
        # Under `auto` the model's max_new_tokens is a default, not a cap.
        longer = client.post("/v1/chat/completions", json={**chat, "max_tokens": 6}).json()
        assert longer["usage"]["completion_tokens"] == 6
        completion = {"prompt": "a b", "max_tokens": None}  # completions default to 16
        usage = client.post("/v1/completions", json=completion).json()["usage"]
        assert usage["completion_tokens"] == 4
    with (
        mock_server(sampling_defaults={"max_tokens": 1000}) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        # A default beyond what the prompt leaves of max_model_len (128) is cut, not refused.
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128


def test_a_generation_config_max_new_tokens_override_caps_every_request():
    """--override-generation-config's max_new_tokens (or a --generation-config folder's) caps
    even a request's own max_tokens, as vLLM's override_max_tokens does."""
    chat = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 6}
    for settings in (
        dict(override_generation_config={"max_new_tokens": 3}, sampling_defaults={"max_tokens": 3}),
        dict(generation_config="/models/gen", sampling_defaults={"max_tokens": 3}),
    ):
        with (
            mock_server(**settings) as running,
            httpx.Client(base_url=running.base_url, timeout=30) as client,
        ):
            for body in (chat, {**chat, "max_tokens": 2}):
                usage = client.post("/v1/chat/completions", json=body).json()["usage"]
                assert usage["completion_tokens"] == min(3, body["max_tokens"])
            completion = {"prompt": "a b", "max_tokens": 10}
            usage = client.post("/v1/completions", json=completion).json()["usage"]
            assert usage["completion_tokens"] == 3


# Renders the content words only: "the cat" is 2 tokens (the mock's own template adds roles).
CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 1}


def test_a_request_chat_template_needs_the_server_to_trust_it():
    """vLLM's rule: a request's `chat_template` (or that key of chat_template_kwargs) is a 400
    naming `chat_template` unless the server runs with --trust-request-chat-template; with it,
    the request's template renders the prompt, on /v1/chat/completions and /tokenize alike."""
    tokenize = {"messages": CHAT["messages"]}
    brought = (
        {"chat_template": CONTENT_ONLY},
        {"chat_template_kwargs": {"chat_template": CONTENT_ONLY}},
    )
    with (
        mock_server() as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        own = client.post("/v1/chat/completions", json=CHAT).json()["usage"]["prompt_tokens"]
        assert own == 4  # "user the cat assistant" by the model's template
        for fields in brought:
            for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", tokenize)):
                response = client.post(path, json={**body, **fields})
                assert_error(response, "chat_template", "--trust-request-chat-template")
    with (
        mock_server(ServerConfig(trust_request_chat_template=True)) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        for fields in brought:
            response = client.post("/v1/chat/completions", json={**CHAT, **fields})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == 2
            tokens = client.post("/tokenize", json={**tokenize, **fields}).json()["tokens"]
            assert tokens == [VOCAB.index("the"), VOCAB.index("cat")]
        usage = client.post("/v1/chat/completions", json=CHAT).json()["usage"]
        assert usage["prompt_tokens"] == own  # without one, the model's template


def test_tools_are_left_out_of_the_prompt_under_tool_choice_none_when_asked():
    """By default tool_choice "none" still renders the tools (vLLM's default);
    --exclude-tools-when-tool-choice-none leaves them out of a chat request's prompt."""
    tools = [{"type": "function", "function": {"name": "dog"}}]
    body = {**CHAT, "tools": tools, "tool_choice": "none"}
    for exclude, num_prompt_tokens in ((False, 3), (True, 2)):
        llm = mock_llm(max_model_len=128)
        llm.llm_engine.tokenizer.chat_template = (
            "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}" + CONTENT_ONLY
        )
        config = ServerConfig(exclude_tools_when_tool_choice_none=exclude)
        with (
            mock_server(config, llm=llm) as running,
            httpx.Client(base_url=running.base_url, timeout=30) as client,
        ):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == num_prompt_tokens  # "dog the cat"
            # /tokenize has no tool_choice (vLLM's): it renders the tools it is given.
            tokenized = client.post(
                "/tokenize", json={"messages": CHAT["messages"], "tools": tools}
            )
            assert tokenized.json()["count"] == 3


def test_tokenizer_info_is_served_only_when_enabled():
    with (
        mock_server() as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        assert client.get("/tokenizer_info").status_code == 404
    config = ServerConfig(enable_tokenizer_info_endpoint=True)
    with (
        mock_server(config, chat_template=CONTENT_ONLY) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        response = client.get("/tokenizer_info")
        assert response.status_code == 200, response.text
        info = response.json()
        assert (info["bos_token"], info["eos_token"], info["unk_token"]) == ("<s>", "</s>", "<unk>")
        assert info["tokenizer_class"]  # the loaded tokenizer's class
        assert info["chat_template"] == CONTENT_ONLY  # the server's --chat-template


def _access_record(path: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes one."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    return logging.LogRecord(
        ACCESS_LOGGER, logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None
    )


def test_access_log_lines_of_the_given_endpoints_are_dropped():
    drop = AccessLogFilter(["/health", "/metrics"])
    assert not drop.filter(_access_record("/health"))
    assert not drop.filter(_access_record("/metrics?name=x"))  # the query string aside
    assert drop.filter(_access_record("/v1/models"))
    assert drop.filter(_access_record("/healthz"))
    other = logging.LogRecord("octavo", logging.INFO, "", 0, "/health", None, None)
    assert drop.filter(other)
    config = ServerConfig(uvicorn_log_level="info", disable_access_log_for_endpoints=("/health",))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    with (
        mock_server(config) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        logging.getLogger(ACCESS_LOGGER).addHandler(handler)
        try:
            assert client.get("/health").status_code == 200
            assert client.get("/v1/models").status_code == 200
        finally:
            logging.getLogger(ACCESS_LOGGER).removeHandler(handler)
    assert [line for line in lines if "/health" in line] == []
    assert any("GET /v1/models" in line for line in lines), lines
    assert not any(isinstance(f, AccessLogFilter) for f in logging.getLogger(ACCESS_LOGGER).filters)
