"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through both endpoints, and a
vLLM field octavo does not implement refused as a 400 naming it (the lists are audited in
tests/test_vllm_sampling_fields.py)."""

from __future__ import annotations

import pytest

from .utils import assert_error

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _completion(http, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_token_rules_and_truncation_reach_the_sampler(http):
    plain = _completion(http, logprobs=0)
    first_token = plain["logprobs"]["tokens"][0]
    banned = _completion(http, logprobs=0, bad_words=[first_token.strip()])
    assert banned["logprobs"]["tokens"][0] != first_token
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    cut = _completion(http, truncate_prompt_tokens=3)
    assert cut["text"] == _completion(http, prompt=prompt_ids[-3:])["text"]
    allowed = prompt_ids[:4]
    pieces = {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    chat = http.post(
        CHAT,
        json={
            "messages": MESSAGES,
            "max_tokens": 4,
            "temperature": 0,
            "allowed_token_ids": allowed,
            "ignore_eos": True,
            "logprobs": True,
        },
    )
    assert chat.status_code == 200, chat.text
    tokens = [entry["token"] for entry in chat.json()["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 4 and set(tokens) <= pieces


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_vllm_field_octavo_lacks_is_a_400_naming_it(http, path):
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    response = http.post(path, json={**body, "max_tokens": 2, "early_stopping": True})
    assert_error(response, "early_stopping", "not supported")
    response = http.post(path, json={**body, "max_tokens": 2, "allowed_token_ids": [10**9]})
    assert_error(response, "allowed_token_ids", "out of range")
    ok = http.post(path, json={**body, "max_tokens": 2, "early_stopping": False})
    assert ok.status_code == 200, ok.text
