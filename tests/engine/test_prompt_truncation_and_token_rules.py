"""truncate_prompt_tokens gives what the truncated prompt gives; allowed_token_ids and
bad_words are checked and tokenized when a request is added. On the mock model (tests/
mock_engine.py), whose greedy answer depends on the prompt's length; milliseconds each."""

from __future__ import annotations

import pytest

from octavo import SamplingParams

from ..integration.utils import assert_no_leak
from ..mock_engine import VOCAB, mock_llm

PROMPT = " ".join(VOCAB[3:13])  # 10 tokens


def _tokens(llm, prompt, params) -> list[int]:
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return output.outputs[0].token_ids


def test_truncating_the_prompt_equals_passing_its_last_tokens() -> None:
    llm = mock_llm(max_model_len=16)
    ids = llm.llm_engine.input_processor.process_prompt(PROMPT).prompt_token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    for keep in (1, 4, 9, 10, 50):
        truncated = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=keep)
        expected = _tokens(llm, {"prompt_token_ids": ids[-keep:]}, greedy)
        assert _tokens(llm, PROMPT, truncated) == expected
        assert _tokens(llm, {"prompt_token_ids": ids}, truncated) == expected
    # A prompt longer than max_model_len is refused, unless it is cut to fit: -1 keeps what
    # max_model_len leaves after max_tokens.
    long_prompt = " ".join(VOCAB[3:23])  # 20 tokens
    long_ids = llm.llm_engine.input_processor.tokenizer.encode(long_prompt)
    assert len(long_ids) == 20
    with pytest.raises(ValueError, match="max_model_len"):
        _tokens(llm, long_prompt, greedy)
    fit = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=-1)
    assert _tokens(llm, long_prompt, fit) == _tokens(
        llm, {"prompt_token_ids": long_ids[-10:]}, greedy
    )
    (output,) = llm.generate([long_prompt], fit, use_tqdm=False)
    assert output.prompt_token_ids == long_ids[-10:]
    assert_no_leak(llm)


def test_token_rules_are_checked_against_the_vocabulary() -> None:
    llm = mock_llm()
    with pytest.raises(ValueError, match="allowed_token_ids"):
        _tokens(llm, "the cat", SamplingParams(allowed_token_ids=[1, len(VOCAB)]))
    processor = llm.llm_engine.input_processor
    # Whole-word tokens: "cat" and " cat" are one sequence, kept once.
    assert processor.tokenize_bad_words(["cat", " sat on"]) == [
        [VOCAB.index("cat")],
        [VOCAB.index("sat"), VOCAB.index("on")],
    ]
    assert_no_leak(llm)
