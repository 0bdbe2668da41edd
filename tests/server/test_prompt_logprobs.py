"""`prompt_logprobs` (vLLM's extra) and `echo` with `logprobs` on the server: the shapes vLLM
returns. The values themselves are checked against transformers in
tests/model/test_prompt_logprobs.py."""

from __future__ import annotations

import json

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def _num_prompt_tokens(http) -> int:
    response = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_echo_with_logprobs_puts_the_prompt_first(http) -> None:
    num_prompt = _num_prompt_tokens(http)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 2,
    }
    response = http.post(CMPL, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    n = num_prompt + 3
    assert [len(logprobs[key]) for key in logprobs] == [n] * 4
    # The first prompt token has nothing before it: no logprob, no top logprobs.
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    for token, value, top in zip(
        logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]
    ):
        assert 2 <= len(top) <= 3 and top[token] == value
    # Offsets cover the prompt's tokens from 0, then the completion's.
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    for i in range(1, n):
        assert offsets[i] == offsets[i - 1] + len(logprobs["tokens"][i - 1])
    assert "".join(logprobs["tokens"]) == choice["text"]
    # vLLM also returns them as prompt_logprobs (echo with logprobs asked for them).
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == num_prompt and prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:], start=1):
        assert set(next(iter(entry.values()))) == {"logprob", "rank", "decoded_token"}
        assert next(iter(entry.values()))["logprob"] == logprobs["token_logprobs"][i]


def test_echo_with_logprobs_streams_the_prompt_in_the_first_chunk(http) -> None:
    num_prompt = _num_prompt_tokens(http)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 1,
        "stream": True,
    }
    events = [line[6:] for line in http.post(CMPL, json=body).text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    assert len(first["tokens"]) == num_prompt + 1
    assert "prompt_logprobs" not in chunks[0]
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == num_prompt + 3


def test_prompt_logprobs_extra_on_completions_and_chat(http) -> None:
    num_prompt = _num_prompt_tokens(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = http.post(CMPL, json=body).json()["choices"][0]
    assert choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == num_prompt and entries[0] is None
    assert all(2 <= len(entry) <= 3 for entry in entries[1:])
    for entry in entries[1:]:
        own = next(iter(entry.values()))  # the prompt token's own entry comes first
        assert own["rank"] >= 1 and own["logprob"] <= 0
    # Without the extra there is no such field.
    plain = http.post(CMPL, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]

    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    response = http.post(CHAT, json=body).json()
    entries = response["prompt_logprobs"]
    assert len(entries) == response["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:])
    plain = http.post(CHAT, json=dict(body, prompt_logprobs=None)).json()
    assert "prompt_logprobs" not in plain
