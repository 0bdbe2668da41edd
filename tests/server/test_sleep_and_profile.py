"""vLLM's dev-mode sleep endpoints (POST /sleep, /wake_up, GET /is_sleeping) and the profiler
endpoints (POST /start_profile, /stop_profile) on the session server, whose engine core runs in
a process of its own: the calls cross that boundary as the other utility calls do."""

from __future__ import annotations

import os
import threading
import time

import httpx

from octavo.entrypoints.server.app import ServerConfig

from .mock_server import mock_server

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def _text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_each_level_wakes_up_to_the_same_tokens(server, http) -> None:
    before = _text(http)
    for level in (1, 2):
        assert http.post(f"/sleep?level={level}").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _text(http) == before
    server.assert_no_leak()


def test_a_request_sent_while_asleep_runs_after_wake_up(server, http) -> None:
    expected = _text(http)
    assert http.post("/sleep?level=1").status_code == 200
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(_text(http)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()  # it waits in the engine core
    assert http.post("/wake_up?tags=weights&tags=kv_cache&tags=scheduling").status_code == 200
    thread.join(60)
    assert result == [expected]
    server.assert_no_leak()


def test_bad_sleep_arguments_are_400_naming_them(http) -> None:
    for query, param in (("level=3", "level"), ("level=one", "level"), ("mode=keep", "mode")):
        response = http.post(f"/sleep?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = http.post("/wake_up?tags=everything")
    assert response.status_code == 400 and response.json()["error"]["param"] == "tags"
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_the_profiler_endpoints_write_a_trace(server, http) -> None:
    assert http.post("/start_profile").status_code == 200
    _text(http)
    assert http.post("/stop_profile").status_code == 200
    traces = [name for name in os.listdir(server.trace_dir) if ".pt.trace.json" in name]
    assert traces


def test_sleep_needs_sleep_mode_and_profiling_needs_a_profiler() -> None:
    with mock_server(ServerConfig(enable_dev_endpoints=True)) as running:
        response = httpx.post(running.base_url + "/sleep")
        assert response.status_code == 400 and "enable_sleep_mode" in response.text
        assert httpx.get(running.base_url + "/is_sleeping").json() == {"is_sleeping": False}
        assert httpx.post(running.base_url + "/start_profile").status_code == 404
    with mock_server() as running:
        assert httpx.post(running.base_url + "/sleep").status_code == 404
