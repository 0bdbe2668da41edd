"""allowed_token_ids, bad_words and truncate_prompt_tokens on the real model, against its own
greedy answer: what the model would pick first is forbidden, and never appears."""

from __future__ import annotations

import pytest

from octavo import SamplingParams

from .utils import assert_no_leak

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _greedy(llm, prompt, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **extra)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_a_disallowed_or_bad_argmax_never_appears(llm) -> None:
    plain = _greedy(llm, PROMPT)
    first = plain.token_ids[0]
    # allowed_token_ids: the greedy answer's tokens but its first one.
    allowed = sorted(set(plain.token_ids) - {first}) + [13]
    constrained = _greedy(llm, PROMPT, allowed_token_ids=allowed)
    assert constrained.token_ids[0] != first
    assert set(constrained.token_ids) <= set(allowed)
    # bad_words: the answer's first word, in whatever form the model wrote it.
    word = llm.get_tokenizer().decode([first]).strip()
    banned = _greedy(llm, PROMPT, bad_words=[word])
    ids = llm.llm_engine.input_processor.tokenize_bad_words([word])
    singles = {seq[0] for seq in ids if len(seq) == 1}
    assert first in singles and not singles & set(banned.token_ids)
    assert word not in banned.text.split()
    assert_no_leak(llm)


def test_truncation_gives_the_answer_of_the_truncated_prompt(llm) -> None:
    ids = llm.get_tokenizer().encode("Tell me a story. " * 8 + PROMPT)
    cut = _greedy(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=6)
    assert cut.token_ids == _greedy(llm, {"prompt_token_ids": ids[-6:]}).token_ids
    assert_no_leak(llm)
