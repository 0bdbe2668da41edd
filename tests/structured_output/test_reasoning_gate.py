"""Output constraints under a reasoning parser hold from the end of the thinking (vLLM's
rule): the gate's prompt rule, the mask rows while thinking and after, and the whole engine
on a tiny random Llama whose tokenizer has <think> and </think> as tokens."""

from __future__ import annotations

import numpy as np
import pytest

from octavo import LLM, SamplingParams
from octavo.core.sampling_params import StructuredOutputsParams
from octavo.engine.tokenizer import load_tokenizer
from octavo.model.loader import find_default_model
from octavo.structured_output import StructuredOutputManager
from octavo.structured_output.reasoning import ReasoningGate, ThinkingGatedGrammar

from .conftest import EOS_TOKEN_ID, tiny_llm_folder

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def thinking_tokenizer():
    tokenizer = load_tokenizer(find_default_model())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


@pytest.fixture(scope="module")
def thinking_llm(thinking_tokenizer, tmp_path_factory) -> LLM:
    folder = tiny_llm_folder(thinking_tokenizer, tmp_path_factory.mktemp("tiny-thinking-llama"))
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        kv_cache_tokens=4096,
        seed=0,
        reasoning_parser="deepseek_r1",
    )


def test_the_gate_reads_the_prompt_as_vllm_does(thinking_tokenizer, tokenizer) -> None:
    gate = ReasoningGate.for_tokenizer("qwen3", thinking_tokenizer)
    start, end = gate.start_token_id, gate.end_token_id
    assert thinking_tokenizer.convert_ids_to_tokens([start, end]) == ["<think>", "</think>"]
    assert gate.is_thinking_after([5, 6]) is True  # the output starts inside the thinking
    assert gate.is_thinking_after([5, start, 6]) is True
    assert gate.is_thinking_after([start, 6, end, 7]) is False  # thinking turned off
    assert gate.is_thinking_after([end, 7, start]) is True  # a new turn opened it again
    # No parser, or no such tokens: no gate.
    assert ReasoningGate.for_tokenizer(None, thinking_tokenizer) is None
    assert ReasoningGate.for_tokenizer("deepseek_r1", tokenizer) is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ReasoningGate.for_tokenizer("nope", thinking_tokenizer)


def test_mask_rows_allow_everything_until_the_end_of_thinking(thinking_tokenizer) -> None:
    manager = StructuredOutputManager(
        thinking_tokenizer, len(thinking_tokenizer), (EOS_TOKEN_ID,), reasoning_parser="qwen3"
    )
    end = manager.reasoning_gate.end_token_id
    params = StructuredOutputsParams(choice=CHOICES)
    gated = manager.grammar_for(params, [10, 11])
    plain = manager.grammar_for(params, [10, end, 11])
    assert isinstance(gated, ThinkingGatedGrammar) and not isinstance(plain, ThinkingGatedGrammar)
    assert gated.is_ready() or (gated.grammar._compiled.result(timeout=30) and gated.is_ready())
    assert plain.is_ready()
    thinking_row, constrained_row = manager.grammar_bitmask([gated, plain])
    assert (thinking_row == -1).all()
    assert not (constrained_row == -1).all()
    # Thinking: any token is taken, the grammar is not fed and cannot fail.
    word = thinking_tokenizer.encode("maybe", add_special_tokens=False)
    for token_id in word:
        assert gated.accept_token(token_id)
    assert gated.error() is None and not gated.is_terminated()
    # A speculative proposal stops short of the end of the thinking; its rows all allow
    # every token.
    assert gated.num_valid([*word, end, *word]) == len(word)
    assert gated.num_valid(word) == len(word)
    rows = manager.grammar_bitmask([gated, plain], [word, []])
    assert (rows[: 1 + len(word)] == -1).all()
    np.testing.assert_array_equal(rows[-1], constrained_row)
    assert gated.accept_token(end) and not gated.thinking
    (row,) = manager.grammar_bitmask([gated])
    np.testing.assert_array_equal(row, constrained_row)  # now constrained, from its start
    assert not gated.accept_token(word[0]) or word[0] in thinking_tokenizer.encode(
        "yes", add_special_tokens=False
    ) + thinking_tokenizer.encode("no", add_special_tokens=False)


def test_the_engine_constrains_the_answer_after_the_thinking(thinking_llm) -> None:
    """The random model is nudged towards </think> (logit_bias): each output thinks for a
    while, unconstrained, then its answer is exactly one of the choices. A prompt that
    closed the thinking itself is constrained from the first token."""
    end = thinking_llm.get_tokenizer().convert_tokens_to_ids("</think>")
    params = [
        SamplingParams(
            max_tokens=48,
            temperature=1.0,
            seed=seed,
            # e^9 against ~49k near-equal logits: about one token in seven ends the thinking.
            logit_bias={end: 9.0},
            skip_special_tokens=False,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        )
        for seed in range(8)
    ]
    outputs = thinking_llm.generate([f"Question {i}:" for i in range(8)], params, use_tqdm=False)
    thoughts = []
    for output in outputs:
        completion = output.outputs[0]
        assert end in completion.token_ids, completion.text
        cut = completion.token_ids.index(end)
        thoughts.append(completion.token_ids[:cut])
        answer = thinking_llm.get_tokenizer().decode(
            completion.token_ids[cut + 1 :], skip_special_tokens=True
        )
        assert answer in CHOICES and completion.finish_reason == "stop", answer
    # The thinking was free: outputs thought before answering, in tokens of every kind.
    assert sum(map(len, thoughts)) >= 8, thoughts

    closed = thinking_llm.generate(
        ["Question:<think>hm</think>"],
        SamplingParams(
            max_tokens=16,
            temperature=1.0,
            seed=0,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert closed.text in CHOICES
