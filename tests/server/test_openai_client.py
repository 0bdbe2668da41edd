"""The server through the official `openai` client: completions and chat, streaming and not,
n > 1, stop, seeds, logprobs, usage and cached tokens."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    return models[0].id


def _greedy(client, model, **kwargs):
    return client.completions.create(model=model, prompt=PROMPT, temperature=0, **kwargs)


def test_completion_greedy_is_deterministic_and_counts_usage(client, model, http) -> None:
    first = _greedy(client, model, max_tokens=8)
    second = _greedy(client, model, max_tokens=8)
    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    assert first.model == model
    assert first.choices[0].text == second.choices[0].text != ""
    assert first.choices[0].finish_reason == "length"
    num_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    usage = first.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, 8)
    assert usage.total_tokens == num_prompt + 8


def test_streamed_completion_equals_the_whole_one(client, model) -> None:
    whole = _greedy(client, model, max_tokens=10).choices[0].text
    chunks = list(
        _greedy(client, model, max_tokens=10, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_streamed_equals_whole_and_opens_with_the_role(client, model) -> None:
    # Both runs below then find the prompt in the prefix cache. (A hit computes the prompt's
    # last rows with the block kernels of the quantized weights, a miss all of them with the
    # dequantized GEMM: logits differ by ~0.1 there, enough to flip a near tie.)
    client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=1)
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=12
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_tokens=12, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content != ""
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"


def test_n_samples_get_their_own_indices(client, model) -> None:
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, temperature=1.0, seed=7, max_tokens=4, stream=True
    )
    by_index: dict[int, str] = {}
    for chunk in chat:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(by_index) == [0, 1]


def test_stop_string_ends_the_text_before_it(client, model) -> None:
    text = _greedy(client, model, max_tokens=12).choices[0].text
    stop = text.strip()[2:5]
    assert stop and stop in text
    stopped = _greedy(client, model, max_tokens=12, stop=[stop]).choices[0]
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"


def test_seed_reproduces_sampled_text(client, model) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=model,
                prompt=PROMPT,
                temperature=1.0,
                seed=seed,
                max_tokens=16,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    # Two seeds agreeing on 16 sampled tokens at temperature 1 is vanishingly unlikely.
    assert sample(1234) != sample(4321)


def test_completion_logprobs(client, model) -> None:
    choice = _greedy(client, model, max_tokens=5, logprobs=3).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 3 <= len(top) <= 4 and token_logprob <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert token_logprob == pytest.approx(max(top.values()))


def test_chat_logprobs(client, model) -> None:
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_usage_reports_cached_tokens_for_a_repeated_prefix(client, model, http) -> None:
    prompt = "Once upon a time in a quiet village by the sea, " * 8
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every full block before the last prompt token (which is always recomputed) is a hit.
    expected = (num_prompt - 1) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens == expected > 0


def test_prompt_lists_token_ids_and_echo(client, model, http) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = _greedy(client, model, max_tokens=4).choices[0].text
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=4)
    assert by_ids.choices[0].text == by_text
    several = client.completions.create(
        model=model, prompt=[PROMPT, "Hello"], n=2, temperature=0, max_tokens=4
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == by_text
    echoed = _greedy(client, model, max_tokens=4, echo=True).choices[0].text
    assert echoed == PROMPT + by_text


def test_beam_search_through_the_engine_process(client, model, server) -> None:
    """use_beam_search over the engine core in its own process (tests/server/test_beam_search.py
    checks the beams themselves against transformers' logits, in-process)."""
    extra = {"use_beam_search": True, "ignore_eos": True}
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, n=3, temperature=0, logprobs=1, extra_body=extra
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.text for c in completion.choices}) == 3
    assert {c.finish_reason for c in completion.choices} == {"length"}
    # Beams of one length rank by their cumulative logprob, best first.
    sums = [sum(c.logprobs.token_logprobs) for c in completion.choices]
    assert sums == sorted(sums, reverse=True)
    assert completion.usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, n=2, temperature=0, extra_body=extra
    )
    assert len({c.message.content for c in chat.choices}) == 2
    server.assert_no_leak()
