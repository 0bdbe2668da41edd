"""Raw HTTP: exact SSE framing, `[DONE]`, the usage chunk; the table of bad requests with their
status and OpenAI error object; auth, CORS, the small endpoints and metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from octavo.entrypoints.server.app import ServerConfig, build_app
from octavo.metrics.prometheus import PrometheusStatLogger

from .conftest import MAX_BODY_BYTES, MAX_MODEL_LEN

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def _events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def test_completion_sse_framing_done_and_usage_chunk(http) -> None:
    body = dict(
        GOOD_COMPLETION,
        max_tokens=4,
        stream=True,
        temperature=0,
        ignore_eos=True,
        stream_options={"include_usage": True},
    )
    response = http.post(CMPL, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert set(usage_chunk["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for chunk in chunks[:-1]:
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert chunk["usage"] is None
        assert set(chunk["choices"][0]) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
        }
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_sse_without_usage_has_no_usage_key(http) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
    }
    events = _events(http.post(CHAT, json=body).text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


LONG_PROMPT = "word " * (MAX_MODEL_LEN + 50)
HALF_PROMPT = "word " * (MAX_MODEL_LEN - 20)
BAD_REQUESTS = [
    # (name, method, path, body, status, param)
    ("max_tokens negative", "POST", CMPL, dict(GOOD_COMPLETION, max_tokens=-1), 400, "max_tokens"),
    ("max_tokens zero", "POST", CMPL, dict(GOOD_COMPLETION, max_tokens=0), 400, "max_tokens"),
    ("max_tokens huge", "POST", CMPL, dict(GOOD_COMPLETION, max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens not int", "POST", CMPL, dict(GOOD_COMPLETION, max_tokens=1.5), 400, "max_tokens"),
    (
        "temperature negative",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, temperature=-0.5),
        400,
        "temperature",
    ),
    (
        "temperature a string",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, temperature="hot"),
        400,
        "temperature",
    ),
    ("top_p zero", "POST", CMPL, dict(GOOD_COMPLETION, top_p=0), 400, "top_p"),
    ("top_p above one", "POST", CMPL, dict(GOOD_COMPLETION, top_p=1.5), 400, "top_p"),
    ("n zero", "POST", CMPL, dict(GOOD_COMPLETION, n=0), 400, "n"),
    ("n huge", "POST", CMPL, dict(GOOD_COMPLETION, n=100000), 400, "n"),
    (
        "prompt plus max_tokens too long",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, prompt=HALF_PROMPT, max_tokens=100),
        400,
        "max_tokens",
    ),
    ("prompt too long", "POST", CMPL, dict(GOOD_COMPLETION, prompt=LONG_PROMPT), 400, "prompt"),
    ("empty prompt", "POST", CMPL, dict(GOOD_COMPLETION, prompt=""), 400, "prompt"),
    ("empty prompt list", "POST", CMPL, dict(GOOD_COMPLETION, prompt=[]), 400, "prompt"),
    ("token id out of vocab", "POST", CMPL, dict(GOOD_COMPLETION, prompt=[10**9]), 400, "prompt"),
    ("prompt an object", "POST", CMPL, dict(GOOD_COMPLETION, prompt={"a": 1}), 400, "prompt"),
    ("prompt missing", "POST", CMPL, {"model": MODEL}, 400, "prompt"),
    (
        "presence_penalty too big",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, presence_penalty=5),
        400,
        "presence_penalty",
    ),
    (
        "repetition_penalty zero",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, repetition_penalty=0),
        400,
        "repetition_penalty",
    ),
    ("top_k negative", "POST", CMPL, dict(GOOD_COMPLETION, top_k=-5), 400, "top_k"),
    ("logprobs too many", "POST", CMPL, dict(GOOD_COMPLETION, logprobs=50), 400, "logprobs"),
    (
        "min_tokens above max_tokens",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, min_tokens=5),
        400,
        "min_tokens",
    ),
    (
        "stop_token_ids out of vocab",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, stop_token_ids=[10**9]),
        400,
        "stop_token_ids",
    ),
    (
        "logit_bias key not an id",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, logit_bias={"abc": 1}),
        400,
        "logit_bias",
    ),
    (
        "logit_bias value too big",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, logit_bias={"5": 500}),
        400,
        "logit_bias",
    ),
    ("seed beyond 64 bits", "POST", CMPL, dict(GOOD_COMPLETION, seed=2**70), 400, "seed"),
    (
        "stream_options without stream",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "prompt_logprobs with stream",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs too many",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, prompt_logprobs=21),
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs the vocabulary",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, prompt_logprobs=-1),
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs negative",
        "POST",
        CMPL,
        dict(GOOD_COMPLETION, prompt_logprobs=-2),
        400,
        "prompt_logprobs",
    ),
    ("unknown model", "POST", CMPL, dict(GOOD_COMPLETION, model="gpt-9"), 404, "model"),
    (
        "chat unknown model",
        "POST",
        CHAT,
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model",
    ),
    ("chat messages empty", "POST", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat messages missing", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    (
        "chat message not an object",
        "POST",
        CHAT,
        {"model": MODEL, "messages": ["hi"]},
        400,
        "messages",
    ),
    (
        "chat message without role",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"content": "hi"}]},
        400,
        "messages",
    ),
    (
        "chat unknown role",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages",
    ),
    (
        "chat content a number",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": 123}]},
        400,
        "messages",
    ),
    (
        "chat image part",
        "POST",
        CHAT,
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "messages",
    ),
    (
        "chat top_logprobs without logprobs",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "chat max_completion_tokens huge",
        "POST",
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 10**6,
        },
        400,
        "max_completion_tokens",
    ),
    ("tokenize empty prompt", "POST", "/tokenize", {"prompt": ""}, 400, "prompt"),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("unknown path", "GET", "/v1/nothing", None, 404, None),
    ("wrong method", "GET", CMPL, None, 405, None),
]


@pytest.mark.parametrize(
    "name,method,path,body,status,param", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_request_gets_its_status_and_error_object(
    http, name, method, path, body, status, param
) -> None:
    response = http.request(method, path, json=body)
    _assert_error(response, status, param)
    # The server keeps serving.
    good = http.post(CMPL, json=GOOD_COMPLETION)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1


RAW_BAD_REQUESTS = [
    ("invalid JSON", b"{not json", 400),
    ("JSON array body", b"[1, 2]", 400),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("oversized body", b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}', 413),
]


@pytest.mark.parametrize(
    "name,content,status", RAW_BAD_REQUESTS, ids=[case[0] for case in RAW_BAD_REQUESTS]
)
def test_malformed_body_gets_its_status(http, name, content, status) -> None:
    response = http.post(CMPL, content=content, headers={"content-type": "application/json"})
    _assert_error(response, status, None)
    assert http.post(CMPL, json=GOOD_COMPLETION).status_code == 200


def _assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}]
)
def test_api_key_is_required_everywhere_but_health(server, headers) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", CMPL),
            ("GET", "/metrics"),
            ("GET", "/version"),
        ):
            response = client.request(method, path, headers=headers, json=GOOD_COMPLETION)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health").status_code == 200


def test_cors_is_off_by_default_and_opt_in(server, http) -> None:
    preflight = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST"}
    response = http.get("/version", headers={"Origin": "http://example.test"})
    assert "access-control-allow-origin" not in response.headers
    # Another app over the same running engine, with CORS on (no lifespan: it borrows it).
    app = build_app(
        server.async_engine,
        ServerConfig(allowed_origins=("http://example.test",)),
        PrometheusStatLogger(MODEL),
    )

    async def requests() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return (
                await client.options(CMPL, headers=preflight),
                await client.get("/version", headers={"Origin": "http://example.test"}),
            )

    allowed, version = asyncio.run(requests())
    assert allowed.headers["access-control-allow-origin"] == "http://example.test"
    assert version.headers["access-control-allow-origin"] == "http://example.test"


def test_small_endpoints(http) -> None:
    assert http.get("/version").json() == {"version": "0.1.0"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
    tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "hello world"
    }
    chat_tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat_tokens.json()["count"] > tokens["count"]


def test_metrics_count_tokens_with_vllm_names(server, http) -> None:
    def scrape() -> dict[str, float]:
        values = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("vllm:"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    label = '{engine="0",model_name="SmolLM2-135M-Instruct"}'
    server.wait_idle()
    before = scrape()
    body = {"model": MODEL, "prompt": "One two three", "max_tokens": 5, "ignore_eos": True}
    assert http.post(CMPL, json=body).status_code == 200
    num_prompt = http.post("/tokenize", json={"prompt": "One two three"}).json()["count"]
    after = scrape()
    assert (
        after[f"vllm:generation_tokens_total{label}"]
        - before[f"vllm:generation_tokens_total{label}"]
        == 5
    )
    assert (
        after[f"vllm:prompt_tokens_total{label}"] - before[f"vllm:prompt_tokens_total{label}"]
        == num_prompt
    )
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"vllm:{gauge}{label}"] == 0.0
    types = [line for line in http.get("/metrics").text.splitlines() if line.startswith("# TYPE")]
    assert "# TYPE vllm:num_requests_running gauge" in types
    assert "# TYPE vllm:prompt_tokens_total counter" in types
    # vLLM's HTTP series from the instrumentator, and the process's collectors.
    text = http.get("/metrics").text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"}' in text
    assert "# TYPE http_request_duration_seconds histogram" in text
    assert "process_resident_memory_bytes" in text
