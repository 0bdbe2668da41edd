"""POST /v1/embeddings on a pooling model, through the real openai client: floats, base64
(little-endian float32), token-id inputs; the 400s (input, encoding_format, dimensions, vLLM's
removed normalize), and the 404s of a generation endpoint on a pooling model and of
embeddings on a generation model (the session's server)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import tempfile
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.core_client import AsyncMPEngine
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.run_batch import run_and_shut_down
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import make_server

from ..model.test_embeddings import _hidden, _save_bare_model
from .conftest import RunningServer
from .utils import free_port, start_in_thread

MODEL = "tiny-embedder"


@pytest.fixture(scope="module")
def embedder() -> Iterator[tuple[RunningServer, torch.nn.Module]]:
    folder = tempfile.mkdtemp(prefix="octavo-embed-")
    hf = _save_bare_model(folder, "qwen3")
    async_engine = AsyncMPEngine.from_engine_args(
        EngineArgs(
            model=folder,
            served_model_name=MODEL,
            dtype="float32",
            kv_cache_tokens=512,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=8,
        )
    )
    config = ServerConfig(host="127.0.0.1", port=free_port(), shutdown_timeout_s=5)
    app = make_server_app(async_engine, config)
    uv = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(uv, "embedding-server", 120)
    yield RunningServer(f"http://127.0.0.1:{config.port}", "none", async_engine, app), hf
    uv.should_exit = True
    thread.join(30)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def client(embedder) -> openai.OpenAI:
    server, _ = embedder
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=120)


def _want(hf: torch.nn.Module, prompt: list[int]) -> np.ndarray:
    return torch.nn.functional.normalize(_hidden(hf, prompt)[-1], dim=-1).numpy()


def test_float_and_base64_embeddings_match_transformers(embedder, client) -> None:
    server, hf = embedder
    texts = ["t5 t9 t33 t10 t7 t8 t9 t10 t11 t12 t13", "t40 t41"]
    model_path = server.async_engine.engine.config.model
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer.encode(text) for text in texts]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert floats.model == MODEL and floats.object == "list"
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, prompts))
    for data, prompt in zip(floats.data, prompts):
        np.testing.assert_allclose(data.embedding, _want(hf, prompt), rtol=1e-4, atol=1e-5)
    # Without encoding_format the client asks for base64 and decodes it itself (little-endian
    # float32); with it, the string is the caller's to decode.
    decoded = client.embeddings.create(model=MODEL, input=texts)
    encoded = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    for by_client, by_us, reference in zip(decoded.data, encoded.data, floats.data):
        want = np.asarray(reference.embedding, dtype=np.float32)
        # (Separate calls: a prefix-cache hit may round the last bits differently.)
        np.testing.assert_allclose(by_client.embedding, want, rtol=1e-5, atol=1e-6)
        vector = np.frombuffer(base64.b64decode(by_us.embedding), dtype="<f4")
        np.testing.assert_allclose(vector, want, rtol=1e-5, atol=1e-6)
    raw = httpx.post(
        server.base_url + "/v1/embeddings",
        json={"input": texts[1], "encoding_format": "base64"},
        timeout=60,
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, floats.data[1].embedding, rtol=1e-5, atol=1e-6)
    server.assert_no_leak()


def test_token_id_inputs_and_vllm_extras(embedder, client) -> None:
    server, hf = embedder
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, _want(hf, [5, 6, 7]), rtol=1e-4, atol=1e-5)
    many = client.embeddings.create(
        model=MODEL, input=[[5, 6, 7], [9, 10, 11, 12, 13]], encoding_format="float"
    )
    assert len(many.data) == 2
    # Batched with another prompt: the matmuls may take another kernel (rows), same values.
    np.testing.assert_allclose(many.data[0].embedding, one.data[0].embedding, rtol=1e-4, atol=1e-6)
    raw = client.embeddings.create(
        model=MODEL,
        input=[[5, 6, 7, 8, 9]],
        encoding_format="float",
        extra_body={"use_activation": False, "truncate_prompt_tokens": 3},
    )
    np.testing.assert_allclose(
        raw.data[0].embedding, _hidden(hf, [7, 8, 9])[-1].numpy(), rtol=1e-4, atol=1e-5
    )
    assert raw.usage.prompt_tokens == 3
    server.assert_no_leak()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": 5}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["t5", 6]}, "input"),
        ({"input": [{"role": "user", "content": "hi"}]}, "input"),
        ({"input": "t5", "dimensions": 8}, "dimensions"),
        ({"input": "t5", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "t5", "encoding_format": "utf8"}, "encoding_format"),
        ({"input": "t5", "normalize": False}, "normalize"),
        ({"input": "t5", "truncation_side": "right"}, "truncation_side"),
        ({"input": "t5", "priority": 3}, "priority"),
        ({"input": "t5", "model": "other"}, "model"),
        ({"input": [300]}, "input"),
    ],
)
def test_bad_requests_name_the_parameter(embedder, body, param) -> None:
    server, _ = embedder
    response = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param


def test_generation_endpoints_are_404_on_a_pooling_model(embedder, client) -> None:
    with pytest.raises(openai.NotFoundError, match="Completions API"):
        client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="Chat Completions API"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    server, _ = embedder
    response = httpx.post(server.base_url + "/v1/rerank", json={}, timeout=60)
    assert response.status_code == 404


def test_embeddings_are_404_on_a_generation_model(http) -> None:
    response = http.post("/v1/embeddings", json={"input": "hello"})
    assert response.status_code == 404
    assert "Embeddings API" in response.json()["error"]["message"]


def test_run_batch_answers_embedding_lines(tmp_path) -> None:
    """`octavo run-batch` over a pooling model: /v1/embeddings lines answered by the server's
    handler (the vector transformers gives), a completion line 404 as the server answers."""
    hf = _save_bare_model(tmp_path, "qwen3")
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tmp_path), dtype="float32", kv_cache_tokens=256, block_size=4)
    )
    lines = [
        json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": [[5, 6, 7]]}}),
        json.dumps({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "t5"}}),
        json.dumps({"custom_id": "s", "url": "/v1/score", "body": {}}),
    ]
    output = io.StringIO()
    asyncio.run(run_and_shut_down(AsyncEngine(engine), ServerConfig(), lines, output))
    results = [json.loads(text) for text in output.getvalue().splitlines()]
    assert [r["response"]["status_code"] for r in results] == [200, 404, 404]
    body = results[0]["response"]["body"]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    np.testing.assert_allclose(
        body["data"][0]["embedding"], _want(hf, [5, 6, 7]), rtol=1e-4, atol=1e-5
    )
