"""The whole engine path (InputProcessor validation, manager, scheduler, runner mask, sampler)
through the offline LLM API, on a tiny random Llama with the embedded model's vocabulary: its
text is noise, so any output that fits a constraint fits because the constraint was enforced."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from octavo import SamplingParams
from octavo.core.sampling_params import StructuredOutputsParams

from .conftest import EOS_TOKEN_ID

PROMPT = "Write the answer:"

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["cat", "dog", "bird"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "kind", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"enum": ["ann", "bob"]},
                    "age": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["owner", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
]


def generate(llm, params, prompts=(PROMPT,)):
    return llm.generate(list(prompts), params, use_tqdm=False)


def structured(max_tokens: int = 64, **kwargs) -> SamplingParams:
    kind = {
        k: kwargs.pop(k)
        for k in list(kwargs)
        if k in ("json", "regex", "choice", "grammar", "json_object")
    }
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind), **kwargs
    )


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(tiny_llm, schema, temperature) -> None:
    (out,) = generate(tiny_llm, structured(json=schema, temperature=temperature, seed=3))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), schema)


def test_choice_regex_grammar_and_json_object(tiny_llm) -> None:
    outs = generate(
        tiny_llm,
        [
            structured(choice=["alpha", "beta", "gamma"], temperature=1.0, seed=1),
            structured(regex=r"[A-Z]{2}-\d{3}", temperature=1.0, seed=2),
            structured(grammar='start: "(" ("x" | "y")+ ")"', max_tokens=8, temperature=0),
            structured(json_object=True, temperature=0),
        ],
        prompts=[PROMPT] * 4,
    )
    choice, regex, grammar, json_object = (o.outputs[0] for o in outs)
    assert choice.text in ("alpha", "beta", "gamma") and choice.finish_reason == "stop"
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.text) and regex.finish_reason == "stop"
    # An unbounded grammar is cut by max_tokens: a prefix of a valid sentence.
    assert re.fullmatch(r"\([xy]*\)?", grammar.text)
    assert isinstance(json.loads(json_object.text), dict)


def test_unconstrained_requests_in_the_batch_are_unaffected(tiny_llm) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (alone,) = generate(tiny_llm, plain)
    outs = generate(
        tiny_llm,
        [structured(json=SCHEMAS[0], temperature=0), plain, structured(choice=["x", "y"]), plain],
        prompts=[PROMPT] * 4,
    )
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS[0])


def test_n_children_each_follow_their_own_grammar(tiny_llm) -> None:
    (out,) = generate(tiny_llm, structured(json=SCHEMAS[1], n=4, temperature=1.0, seed=5))
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[1])
    assert len(set(texts)) > 1


def test_logprobs_are_those_of_the_constrained_distribution(tiny_llm) -> None:
    (out,) = generate(tiny_llm, structured(choice=["yes", "no"], logprobs=5, temperature=0))
    first = out.outputs[0].logprobs[0]
    tokenizer = tiny_llm.get_tokenizer()
    # Only the five tokens that can start "yes" or "no" have mass; the rest are -inf.
    allowed = {tokenizer.decode([t]) for t, lp in first.items() if lp.logprob > float("-inf")}
    assert allowed == {"n", "no", "y", "ye", "yes"}


def test_a_complete_grammar_ends_requests_that_ignore_eos_and_beats_min_tokens(tiny_llm) -> None:
    """Regression guard: a complete grammar allows only EOS; min_tokens forbidding EOS too once
    left a row with no token to sample (a token id past the vocabulary; with logprobs, a
    failed step)."""
    outs = generate(
        tiny_llm,
        [
            structured(choice=["ok"], ignore_eos=True, temperature=1.0),
            structured(choice=["ok"], min_tokens=5, temperature=1.0, logprobs=1),
        ],
        prompts=[PROMPT] * 2,
    )
    (ok,) = tiny_llm.get_tokenizer().encode("ok", add_special_tokens=False)
    for out in outs:
        completion = out.outputs[0]
        assert (completion.text, completion.finish_reason) == ("ok", "stop")
        assert completion.token_ids == [ok, EOS_TOKEN_ID]


def test_an_invalid_schema_is_refused_before_anything_is_queued(tiny_llm) -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.json is invalid: Invalid type"):
        generate(
            tiny_llm, [SamplingParams(), structured(json={"type": "nope"})], prompts=[PROMPT] * 2
        )
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
