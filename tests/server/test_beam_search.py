"""`use_beam_search` through the server with the official `openai` client, over a tiny float32
llama served in-process: the beams equal vLLM's algorithm run by the test over transformers'
logits (tests/engine/test_beam_search.py says why that reference and not transformers'
generate where EOS ends beams); chat streams as vLLM streams it; other requests go on while a
search runs; fields a beam search does not honour are a 400 naming them."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import make_server

from ..engine.test_beam_search import EOS, reference_beam_search, save_beam_model
from .conftest import RunningServer
from .utils import assert_error, free_port, start_in_thread

pytestmark = pytest.mark.slow

PROMPT_IDS = [1, 17, 90, 33, 5]
# The whole conversation's text is its user messages' (the tiny tokenizer's words).
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MESSAGES = [{"role": "user", "content": "t5 t33 t90"}]


@pytest.fixture(scope="module")
def beam_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beam-server")
    model = save_beam_model(folder)
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    args = EngineArgs(
        model=str(folder),
        dtype="float32",
        kv_cache_tokens=4096,
        block_size=4,
        max_model_len=128,
        chat_template=str(template),
        served_model_name="m",
    )
    async_engine = AsyncEngine.from_factory(lambda: LLMEngine.from_engine_args(args))
    config = ServerConfig(host="127.0.0.1", port=free_port(), api_key="k", shutdown_timeout_s=5)
    app = make_server_app(async_engine, config)
    uv = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(uv, "beam-server", 60)
    yield RunningServer(f"http://127.0.0.1:{config.port}", "k", async_engine, app), model
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(beam_server) -> openai.OpenAI:
    server, _ = beam_server
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", timeout=120)


@pytest.fixture(scope="module")
def http(beam_server):
    server, _ = beam_server
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def _decode(server: RunningServer, token_ids: list[int]) -> str:
    return server.async_engine.engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def _expected(beam_server, prompt, k, max_tokens, length_penalty):
    """Per beam of the reference: (generated ids without a final EOS, text, finish reason,
    cum_logprob)."""
    server, model = beam_server
    beams = []
    for tokens, cum in reference_beam_search(model, prompt, k, max_tokens, length_penalty, False):
        generated = tokens[len(prompt) :]
        stopped = generated[-1] == EOS
        ids = generated[:-1] if stopped else generated
        beams.append((ids, _decode(server, ids), "stop" if stopped else "length", cum))
    return beams


@pytest.mark.parametrize("k, length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_completion_beams_are_the_reference(beam_server, client, k, length_penalty):
    server, _ = beam_server
    expected = _expected(beam_server, PROMPT_IDS, k, 8, length_penalty)
    assert any(reason == "stop" for _, _, reason, _ in expected) or k == 2
    response = client.completions.create(
        model="m",
        prompt=PROMPT_IDS,
        max_tokens=8,
        n=k,
        temperature=0,
        logprobs=2,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty},
    )
    assert [c.index for c in response.choices] == list(range(k))
    assert [c.text for c in response.choices] == [text for _, text, _, _ in expected]
    assert [c.finish_reason for c in response.choices] == [r for _, _, r, _ in expected]
    for choice, (ids, _, reason, cum) in zip(response.choices, expected):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids)
        assert all(len(top) <= 3 for top in logprobs.top_logprobs)
        if reason == "length":  # every logprob of the beam is reported (no EOS left out)
            assert sum(logprobs.token_logprobs) == pytest.approx(cum, abs=1e-3)
    assert response.usage.prompt_tokens == len(PROMPT_IDS)
    assert response.usage.completion_tokens == sum(len(ids) for ids, _, _, _ in expected)
    server.assert_no_leak()


def test_several_prompts_and_include_stop_str_in_output(beam_server, client):
    second = [1, 200, 4]
    response = client.completions.create(
        model="m",
        prompt=[PROMPT_IDS, second],
        max_tokens=6,
        n=2,
        temperature=0,
        extra_body={"use_beam_search": True, "include_stop_str_in_output": True},
    )
    texts = [c.text for c in response.choices]
    expected = [
        text
        for prompt in (PROMPT_IDS, second)
        for _, text, _, _ in _expected(beam_server, prompt, 2, 6, 1.0)
    ]
    assert texts == expected  # choice index = prompt index * n + beam index


def test_chat_beam_search_streams_as_vllm_does(beam_server, client):
    server, _ = beam_server
    prompt = server.async_engine.engine.tokenizer("t5 t33 t90 ").input_ids
    expected = _expected(beam_server, prompt, 3, 6, 1.0)
    body = dict(model="m", messages=MESSAGES, max_tokens=6, n=3, temperature=0)
    extra = {"use_beam_search": True}
    whole = client.chat.completions.create(**body, extra_body=extra)
    assert [c.message.content for c in whole.choices] == [text for _, text, _, _ in expected]
    assert [c.finish_reason for c in whole.choices] == [r for _, _, r, _ in expected]
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body=extra))
    # A role delta per choice, then each beam's whole text, with its finish reason, at once.
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:3]] == [
        (i, "assistant") for i in range(3)
    ]
    ends = chunks[3:]
    assert [c.choices[0].delta.content for c in ends] == [text for _, text, _, _ in expected]
    assert [c.choices[0].finish_reason for c in ends] == [r for _, _, r, _ in expected]
    server.assert_no_leak()


def test_a_beam_search_does_not_hold_back_other_requests(beam_server, client):
    server, _ = beam_server
    done: dict[str, float] = {}

    def search() -> None:
        client.completions.create(
            model="m",
            prompt=PROMPT_IDS,
            max_tokens=120,
            n=8,
            temperature=0,
            extra_body={"use_beam_search": True, "ignore_eos": True},
        )
        done["search"] = time.monotonic()

    thread = threading.Thread(target=search)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.call(lambda engine: engine.has_unfinished_requests()):  # under way
        assert time.monotonic() < deadline
        time.sleep(0.01)
    plain = client.completions.create(
        model="m", prompt=[1, 200, 4], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    done["plain"] = time.monotonic()
    thread.join(120)
    assert plain.choices[0].finish_reason == "length"
    assert done["plain"] < done["search"]
    server.assert_no_leak()


def test_a_disconnected_search_leaves_nothing_behind(beam_server, http):
    server, _ = beam_server
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 120,
        "n": 8,
        "use_beam_search": True,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.2)
    server.assert_no_leak()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"n": 0}, "n", "n must be"),
        ({"n": 11}, "n", "max_logprobs=20"),
        ({"top_p": 0.5}, "top_p", "not supported with beam search"),
        ({"top_k": 5}, "top_k", "not supported with beam search"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported with beam search"),
        ({"stop": ["t9"]}, "stop", "not supported with beam search"),
        ({"min_tokens": 2}, "min_tokens", "not supported with beam search"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported with beam search"),
        ({"structured_outputs": {"regex": "t1"}}, "structured_outputs", "beam search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported with beam search"),
        ({"early_stopping": True}, "early_stopping", "not supported"),
        ({"length_penalty": "long"}, "length_penalty", ""),
    ],
)
def test_what_a_beam_search_cannot_serve_is_a_400_naming_it(http, path, extra, param, fragment):
    body = {"prompt": PROMPT_IDS} if path == "/v1/completions" else {"messages": MESSAGES}
    body.update(max_tokens=4, n=2, use_beam_search=True)
    assert_error(http.post(path, json={**body, **extra}), param, fragment)
    ok = http.post(path, json={**body, "early_stopping": False, "length_penalty": 0.5})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_length_penalty_without_beam_search_is_a_400(http, path):
    body = {"prompt": PROMPT_IDS} if path == "/v1/completions" else {"messages": MESSAGES}
    response = http.post(path, json={**body, "max_tokens": 2, "length_penalty": 0.5})
    assert_error(response, "length_penalty", "use_beam_search")
    ok = http.post(path, json={**body, "max_tokens": 2, "length_penalty": 1.0})
    assert ok.status_code == 200, ok.text


def test_completion_only_refusals(http):
    body = {"prompt": PROMPT_IDS, "max_tokens": 4, "n": 2, "use_beam_search": True}
    # vLLM's: no stream, and no echo with logprobs (a search computes no prompt logprobs).
    assert_error(http.post("/v1/completions", json={**body, "stream": True}), "stream", "Stream")
    response = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})
    assert_error(response, "echo", "prompt logprobs")
    response = http.post("/v1/completions", json={**body, "best_of": 3})
    assert_error(response, "best_of", "best_of")
    echoed = http.post("/v1/completions", json={**body, "echo": True, "best_of": 2})
    assert echoed.status_code == 200, echoed.text
    assert all(c["text"].startswith("t1 t17 t90 t33 t5") for c in echoed.json()["choices"])


def test_a_tool_choice_constraint_is_refused(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "use_beam_search": True,
        "tools": [tool],
        "tool_choice": "required",
    }
    assert_error(http.post("/v1/chat/completions", json=body), "tool_choice", "beam search")


def test_seeded_sampling_temperature_draws_the_same_beams(client):
    """Beam search at temperature 1 (the default): the logprobs are the raw ones, and a drawn
    token joins the candidates only from outside the top 2k, which never makes a live beam;
    with a seed the draw, and so the result, repeats."""
    body = dict(model="m", prompt=PROMPT_IDS, max_tokens=5, n=2, seed=7)
    extra = {"use_beam_search": True}
    first = client.completions.create(**body, extra_body=extra)
    second = client.completions.create(**body, extra_body=extra)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
