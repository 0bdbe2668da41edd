"""One hostile request must not hurt anyone else: each class of input that used to fail other
requests, freeze the event loop, answer 500, break a constraint silently or cost unbounded work
is refused as a 4xx (OpenAI's error object, the offending parameter, the connection kept), or
ends alone, while the requests around it complete."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from octavo.entrypoints.server.app import ServerConfig
from octavo.entrypoints.server.request_body import MAX_JSON_COST, MAX_JSON_DEPTH

from .conftest import BODY_READ_TIMEOUT_S, HEADER_READ_TIMEOUT_S
from .mock_server import mock_server
from .utils import assert_error

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON_HEADERS = {"content-type": "application/json"}


def test_a_seed_that_overflows_in_its_children_is_refused_and_the_others_run_on(server, http):
    """It used to pass validation and overflow inside the step, failing every request in
    flight (4 of 4 in the probe), again and again."""
    results: list[list[str]] = []
    threads = []
    for _ in range(3):
        thread = threading.Thread(target=lambda: results.append(_one_stream(server)), daemon=True)
        thread.start()
        threads.append(thread)
    time.sleep(0.5)
    poison = {"prompt": "x", "n": 2, "seed": 2**64 - 1, "max_tokens": 4, "temperature": 1.0}
    response = http.post(COMPLETIONS, json=poison)
    assert_error(response, "seed", "seed must be at most 18446744073709551614 with n=2")
    for thread in threads:
        thread.join(120)
    assert len(results) == 3 and all(_finished_ok(lines) for lines in results)
    server.assert_no_leak()


def _finished_ok(lines: list[str]) -> bool:
    return bool(lines) and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)


def _one_stream(server) -> list[str]:
    body = {"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.base_url + COMPLETIONS, json=body, headers=server.headers, timeout=120
    ) as response:
        return [line for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "raw, param, message",
    [
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "unpaired UTF-16 surrogate"),
        (b'{"prompt": "\\udc00", "max_tokens": 2}', "prompt", "unpaired UTF-16 surrogate"),
        (
            b'{"prompt": "a", "max_tokens": 2, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            None,
            "nests deeper than",
        ),
        (
            b'{"prompt": "a", "stop": '
            + b"[" * (MAX_JSON_DEPTH + 2)
            + b"]" * (MAX_JSON_DEPTH + 2)
            + b"}",
            "stop",
            "nests deeper than 64 levels",
        ),
    ],
)
def test_malformed_bodies_are_400s_that_keep_the_connection(http, raw, param, message):
    response = http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_error(response, param, message)
    assert response.headers.get("connection") != "close"
    assert http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_a_deeply_nested_tool_schema_is_a_400_naming_tools(http):
    depth = 200
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    body = (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": '
        '"function", "function": {"name": "f", "parameters": ' + schema + "}}]}"
    )
    response = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error(response, "tools", "nests deeper than 64 levels")


def _raw(server, data: bytes, read: bool = True, wait_s: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(data)
        if wait_s:
            time.sleep(wait_s)
        if not read:
            return b""
        sock.settimeout(30)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b"}" in chunk:
                break
        return b"".join(chunks)


def _head(server, length: int) -> bytes:
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_a_client_leaving_mid_body_costs_one_log_line_and_no_traceback(server, http, caplog):
    _raw(server, _head(server, 1000) + b'{"prompt": "a', read=False)
    time.sleep(0.5)
    assert http.get("/health").status_code == 200
    assert not any(record.exc_info for record in caplog.records)


def test_slow_bodies_get_408_and_slow_heads_are_closed(server):
    started = time.monotonic()
    reply = _raw(server, _head(server, 100) + b'{"prompt": ', wait_s=0.0)
    assert b" 408 " in reply.split(b"\r\n", 1)[0] and b"did not arrive within" in reply
    assert BODY_READ_TIMEOUT_S <= time.monotonic() - started < BODY_READ_TIMEOUT_S + 10
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        sock.settimeout(HEADER_READ_TIMEOUT_S + 10)
        assert sock.recv(1024) == b""  # closed by the server
    assert HEADER_READ_TIMEOUT_S <= time.monotonic() - started < HEADER_READ_TIMEOUT_S + 10


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"regex": "[^\\s\\S]"}, "structured_outputs.regex cannot be followed by any output"),
        ({"choice": [f"option {i}" for i in range(2001)]}, "the grammar engine follows at most"),
        ({"regex": "a" * (300 * 1024)}, "characters long; at most 262144"),
    ],
)
def test_a_constraint_the_grammar_engine_cannot_follow_is_refused(http, constraint, message):
    """These used to return 200 with empty text and finish_reason "stop"."""
    response = http.post(
        COMPLETIONS, json={"prompt": "Pick:", "max_tokens": 8, "structured_outputs": constraint}
    )
    assert_error(response, "structured_outputs", message)


def test_work_per_request_is_bounded(http):
    many = http.post(COMPLETIONS, json={"prompt": ["a"] * 64, "n": 8, "max_tokens": 1})
    assert_error(many, "prompt", "asks for 512 sequences (64 prompts x n=8); at most 256")
    degenerate = http.post(
        COMPLETIONS, json={"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1e-46}
    )
    assert_error(degenerate, "repetition_penalty", "positive and finite")
    huge = http.post("/tokenize", json={"prompt": "word " * 200_000})
    assert_error(huge, "prompt", "more than max_model_len=1024 tokens can hold")


def test_json_that_would_hold_the_event_loop_to_decode_is_refused_unread(http):
    """1M empty arrays are a 4 MB body that json.loads takes ~0.5 s over, holding the GIL (the
    event loop and every stream with it); such bodies are counted, not decoded. A large body of
    the kind real requests carry (a long token-id prompt) is decoded as before."""
    arrays = {"prompt": "a", "x": [[]] * (MAX_JSON_COST // 4)}
    keys = {"prompt": "a", "logit_bias": {str(i): 0 for i in range(MAX_JSON_COST // 5 + 1)}}
    for data in (arrays, keys):
        content = json.dumps(data, separators=(",", ":"))
        response = http.post(COMPLETIONS, content=content, headers=JSON_HEADERS)
        assert_error(response, None, "too much JSON to decode", status=413)
    long_ids = http.post(COMPLETIONS, json={"prompt": [7] * 100_000, "max_tokens": 1})
    assert_error(long_ids, "prompt", "max_model_len")


def test_preparing_a_request_never_holds_the_event_loop(server, http, monkeypatch):
    """A request whose preparation keeps the CPU (in Python, holding the GIL between switches)
    for a second: /health answers throughout, because preparation runs in its own thread."""
    processor = server.async_engine.engine.input_processor
    process_prompt = processor.process_prompt

    def slow_process_prompt(prompt, *args, **kwargs):
        if prompt == "slow":
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                pass
        return process_prompt(prompt, *args, **kwargs)

    monkeypatch.setattr(processor, "process_prompt", slow_process_prompt)
    result = []
    thread = threading.Thread(
        target=lambda: result.append(
            http.post(COMPLETIONS, json={"prompt": "slow", "max_tokens": 1})
        ),
        daemon=True,
    )
    worst = 0.0
    with httpx.Client(base_url=server.base_url, timeout=30) as health:
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            assert health.get("/health").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            time.sleep(0.02)
    assert result[0].status_code == 200
    assert worst < 0.5, f"/health took {worst:.2f} s while a request was being prepared"


def test_dev_endpoints_need_the_key_and_several_authorization_headers_are_refused(server):
    open_client = httpx.Client(base_url=server.base_url, timeout=30)
    assert open_client.post("/reset_prefix_cache").status_code == 401
    two = open_client.post(
        "/v1/models",
        headers=[("Authorization", "Bearer x"), ("Authorization", f"Bearer {server.api_key}")],
    )
    assert_error(two, None, "more than one Authorization header")
    open_client.close()


def test_dev_endpoints_are_off_unless_enabled():
    with mock_server() as running:
        assert httpx.post(running.base_url + "/reset_prefix_cache").status_code == 404
    with mock_server(ServerConfig(enable_dev_endpoints=True)) as running:
        assert httpx.post(running.base_url + "/reset_prefix_cache").json() == {"success": True}


def test_streams_cut_by_shutdown_end_with_an_error_event_and_done():
    with mock_server(ServerConfig(shutdown_timeout_s=2.0), slow=True) as running:
        lines: list[str] = []

        def read() -> None:
            body = {"prompt": "the cat", "max_tokens": 120, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", running.base_url + COMPLETIONS, json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.5)
        started = time.monotonic()
        running.stop()
        reader.join(30)
        assert time.monotonic() - started < 10
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["message"] == "The server is shutting down." and error["code"] is None
