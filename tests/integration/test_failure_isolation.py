"""One request's failure is its own: a fault injected into one request's preparation or into
its sampling ends that request with FinishReason.ERROR and frees its blocks, and every other
request of the batch produces exactly the tokens it produces without the faulty one, seeded
random draws included."""

from __future__ import annotations

import pytest

from octavo import SamplingParams
from octavo.core.request import FinishReason
from octavo.sample import sampler as sampler_module
from octavo.worker.input_batch import InputBatch

from .utils import assert_no_leak

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the bicycle begins",
    "A list of prime numbers: 2, 3, 5,",
    "def add(a, b):",
    "Rain in the mountains",
    "The three states of water are",
    "Once there was a lighthouse keeper who",
]
POISON_PROMPT = [1, 2, 3, 4, 5, 6, 7]  # token ids no text prompt here starts with


def _params() -> list[SamplingParams]:
    """Greedy and seeded random rows, 12 tokens each."""
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else 100 + i,
            max_tokens=12,
            ignore_eos=True,
        )
        for i in range(len(PROMPTS))
    ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_a_request_that_cannot_join_the_batch_fails_alone(llm, monkeypatch) -> None:
    expected = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
    add = InputBatch.add

    def faulty_add(self, data, generator):
        if data.prompt_token_ids == POISON_PROMPT:
            raise RuntimeError("injected fault")
        return add(self, data, generator)

    monkeypatch.setattr(InputBatch, "add", faulty_add)
    prompts = PROMPTS[:3] + [POISON_PROMPT] + PROMPTS[3:]
    params = _params()[:3] + [SamplingParams(max_tokens=12)] + _params()[3:]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    poison = outputs.pop(3).outputs[0]
    assert poison.finish_reason == FinishReason.ERROR and poison.token_ids == []
    assert poison.error == "joining the batch failed: RuntimeError: injected fault"
    assert _tokens(outputs) == expected
    assert all(o.outputs[0].finish_reason == FinishReason.LENGTH for o in outputs)
    assert_no_leak(llm)


def test_a_request_whose_draw_fails_fails_alone_and_seeded_rows_keep_their_stream(
    llm, monkeypatch
) -> None:
    """The fault strikes after the batch's random draws (in the logprobs step), so the
    redrawn rows must start again from the generator states of before the batched attempt."""
    expected = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
    gather = sampler_module.gather_logprobs

    def faulty_gather(logprobs, k, sampled):
        if k == 7:  # only the poison asks for 7 logprobs
            raise RuntimeError("injected fault")
        return gather(logprobs, k, sampled)

    monkeypatch.setattr(sampler_module, "gather_logprobs", faulty_gather)
    poison_params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=7)
    outputs = llm.generate(
        PROMPTS[:2] + ["Poison:"] + PROMPTS[2:],
        _params()[:2] + [poison_params] + _params()[2:],
        use_tqdm=False,
    )
    poison = outputs.pop(2).outputs[0]
    assert poison.finish_reason == FinishReason.ERROR
    assert poison.error == "sampling failed: RuntimeError: injected fault"
    assert _tokens(outputs) == expected
    assert_no_leak(llm)
