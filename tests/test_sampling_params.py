"""SamplingParams keeps vLLM's defaults and rejects bad values naming the field."""

from __future__ import annotations

import pytest

from octavo import SamplingParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
        16,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and p.min_tokens == 0


def test_greedy_normalises_filters_and_single_stop_string_becomes_a_list() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.1, stop="###")
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-5]),
        ("seed", "x"),
        ("logit_bias", {1: 200.0}),
    ],
)
def test_invalid_values_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_clone_is_independent() -> None:
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    p = SamplingParams(stop=["a"], stop_token_ids=[3], seed=1)
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(4)
    assert p.stop == ["a"] and p.stop_token_ids == [3] and q.seed == 1


def test_output_kind_is_vllms() -> None:
    """Cumulative by default; an int (as it crosses a process boundary) becomes the enum."""
    from octavo.core.sampling_params import RequestOutputKind

    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


@pytest.mark.parametrize(
    "field,value",
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", [True]),
        ("bad_words", ["ok", " "]),
        ("bad_words", [7]),
        ("bad_words", [f"w{i}" for i in range(200)]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_token_rules_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_token_rules_keep_vllms_forms_and_clone_apart() -> None:
    p = SamplingParams(allowed_token_ids=(5, 6), bad_words=["a b", "c", "a b"])
    assert p.allowed_token_ids == [5, 6] and p.bad_words == ["a b", "c"]
    assert SamplingParams().bad_words == [] and SamplingParams().allowed_token_ids is None
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    q = p.clone()
    q.allowed_token_ids.append(7)
    q.bad_words.append("d")
    assert p.allowed_token_ids == [5, 6] and p.bad_words == ["a b", "c"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprob_token_ids", [1]),
        ("prompt_logprob_token_ids", [1]),
        ("prompt_logprob_start", 2),
        ("flat_logprobs", True),
        ("detokenize", False),
        ("stream_interval", 4),
        ("skip_clone", True),
        ("extra_args", {"k": 1}),
        ("skip_reading_prefix_cache", True),
        ("thinking_token_budget", 64),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}),
        ("routed_experts_prompt_start", 3),
        ("trace_decode_token_ids", [1, 2]),
    ],
)
def test_vllm_fields_octavo_lacks_are_refused_unless_off(field: str, value) -> None:
    """Each is a ValueError naming it, never a value kept and ignored; its "off" value (vLLM's
    default) is accepted, so code written for vLLM that spells the default still runs."""
    from octavo.core.sampling_params import UNSUPPORTED_FIELDS

    with pytest.raises(ValueError, match=f"{field}=.* is not supported"):
        SamplingParams(**{field: value})
    for off in UNSUPPORTED_FIELDS[field]:
        SamplingParams(**{field: off})
