"""`octavo run-batch`: a file of OpenAI batch requests answered in order by the server's own
serving code. Over the mock engine (each line's body compared with the mock server's answer
to the same body over HTTP), and through the command line over the embedded model."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from octavo.engine.async_engine import AsyncEngine
from octavo.entrypoints.cli import batch_config_from, main, make_parser, server_config_from
from octavo.entrypoints.run_batch import run_and_shut_down
from octavo.entrypoints.server.app import ServerConfig

from ..mock_engine import mock_llm
from .mock_server import mock_server

CHAT = {
    "model": "mock",
    "messages": [{"role": "user", "content": "the cat"}],
    "max_tokens": 5,
    "temperature": 0,
}
COMPLETION = {"model": "mock", "prompt": "the cat sat", "max_tokens": 4, "temperature": 0}


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


LINES = [
    line("chat-1", "/v1/chat/completions", CHAT),
    line("completion-1", "/v1/completions", COMPLETION),
    '{"custom_id": "broken", "url": ',  # not JSON
    "",  # blank lines are skipped
    line("bad-temperature", "/v1/completions", {**COMPLETION, "temperature": -1}),
    line("embedding", "/v1/embeddings", {"model": "mock", "input": "the cat"}),
    line("get", "/v1/completions", COMPLETION, method="GET"),
    line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
    line("unknown-model", "/v1/completions", {**COMPLETION, "model": "other"}),
    line("chat-2", "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 3}),
]


def run_mock_batch(lines: list[str], config: ServerConfig | None = None) -> list[dict]:
    async_engine = AsyncEngine(mock_llm(max_model_len=128).llm_engine)
    output = io.StringIO()
    num_failed = asyncio.run(
        run_and_shut_down(async_engine, config or ServerConfig(), lines, output)
    )
    results = [json.loads(text) for text in output.getvalue().splitlines()]
    assert num_failed == sum(result["error"] is not None for result in results)
    return results


def without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def test_results_in_input_order_with_per_line_errors() -> None:
    results = run_mock_batch(LINES)
    assert [r["custom_id"] for r in results] == [
        "chat-1",
        "completion-1",
        None,
        "bad-temperature",
        "embedding",
        "get",
        "stream",
        "unknown-model",
        "chat-2",
    ]
    statuses = [r["response"]["status_code"] for r in results]
    assert statuses == [200, 200, 400, 400, 404, 405, 400, 404, 200]
    for result in results:
        assert result["id"].startswith("vllm-")
        assert result["response"]["request_id"].startswith("vllm-batch-")
        ok = result["response"]["status_code"] == 200
        assert (result["error"] is None) == ok
        assert (result["response"]["body"] is not None) == ok
    chat, completion, broken, temperature, embedding, get, stream, model, chat_2 = results
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert completion["response"]["body"]["usage"]["completion_tokens"] == 4
    assert "not valid JSON" in broken["error"]["error"]["message"]
    assert temperature["error"]["error"]["param"] == "temperature"
    assert temperature["error"]["error"]["type"] == "invalid_request_error"
    assert "Embeddings API" in embedding["error"]["error"]["message"]
    assert get["error"]["error"]["param"] == "method"
    assert stream["error"]["error"]["param"] == "stream"
    assert model["error"]["error"]["code"] == "model_not_found"
    assert len(chat_2["response"]["body"]["choices"]) == 2


def test_a_line_answers_as_the_server_does() -> None:
    """Each body is the one the server returns for the same request over HTTP (ids and
    timestamps aside), errors included: the same serving code answers both."""
    bodies = [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETION),
        ("/v1/completions", {**COMPLETION, "logprobs": 2, "echo": True}),
        ("/v1/completions", {**COMPLETION, "temperature": -1}),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "bogus"}}),
    ]
    results = run_mock_batch([line(str(i), url, body) for i, (url, body) in enumerate(bodies)])
    with mock_server() as server, httpx.Client(base_url=server.base_url, timeout=30) as client:
        for (url, body), result in zip(bodies, results, strict=True):
            response = client.post(url, json=body)
            assert result["response"]["status_code"] == response.status_code
            if response.status_code == 200:
                assert without_ids(result["response"]["body"]) == without_ids(response.json())
            else:
                assert result["error"] == response.json()


def test_response_flags_apply() -> None:
    config = ServerConfig(response_role="bot")
    (result,) = run_mock_batch([line("a", "/v1/chat/completions", CHAT)], config)
    assert result["response"]["body"]["choices"][0]["message"]["role"] == "bot"


def test_run_batch_takes_the_servers_response_flags() -> None:
    """The flags that shape responses reach run-batch's ServerConfig as they reach serve's."""
    argv = ["--response-role", "bot", "--reasoning-parser", "qwen3", "--tool-call-parser"]
    argv += ["hermes", "--enable-auto-tool-choice", "--return-tokens-as-token-ids"]
    batch = batch_config_from(make_parser().parse_args(["run-batch", "-i", "a", "-o", "b", *argv]))
    serve = server_config_from(make_parser().parse_args(["serve", *argv]))
    for name in ("response_role", "reasoning_parser", "tool_call_parser"):
        assert getattr(batch, name) == getattr(serve, name) != getattr(ServerConfig(), name)
    assert batch.enable_auto_tool_choice and batch.return_tokens_as_token_ids


def test_urls_are_refused_with_a_clear_message(tmp_path, capsys) -> None:
    code = main(["run-batch", "-i", "https://example.com/in.jsonl", "-o", str(tmp_path / "o")])
    assert code == 2
    assert "not URLs" in capsys.readouterr().err


@pytest.mark.slow
def test_run_batch_command_over_the_embedded_model(tmp_path) -> None:
    """The command as users run it: vLLM's no-effect flags accepted, the engine in its
    engine-core process, results in order."""
    requests = tmp_path / "requests.jsonl"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    requests.write_text(
        "\n".join(
            [
                line("c", "/v1/chat/completions", body),
                line("p", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                "not json",
                line("e", "/v1/embeddings", {"input": "Hello"}),
            ]
        )
        + "\n"
    )
    results_path = tmp_path / "results.jsonl"
    flags = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-tokens", "1024"]
    vllm_flags = ["--output-tmp-dir", str(tmp_path), "--max-log-len", "10"]
    code = main(["run-batch", "-i", str(requests), "-o", str(results_path), *flags, *vllm_flags])
    assert code == 0
    results = [json.loads(text) for text in results_path.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["c", "p", None, "e"]
    assert [r["response"]["status_code"] for r in results] == [200, 200, 400, 404]
    assert results[0]["response"]["body"]["usage"]["completion_tokens"] <= 3
    assert results[1]["response"]["body"]["object"] == "text_completion"
