"""--speculative-config / LLM(speculative_config=...): vLLM's fields resolved with vLLM's
defaults; every field octavo does not take, and every method it does not run, refused naming
it."""

from __future__ import annotations

import pytest

from octavo.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    EngineArgs,
    PlatformInfo,
    SpeculativeConfig,
    resolve_speculative_config,
)
from octavo.entrypoints.cli import make_parser


def test_ngram_defaults_and_fields() -> None:
    assert resolve_speculative_config(None) is None
    config = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig("ngram", 3, 5, 5)
    config = resolve_speculative_config(
        {
            "model": "[ngram]",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 4,
            "disable_by_batch_size": 8,
        }
    )
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 4, 4)
    assert config.disable_by_batch_size == 8
    # Absent: the measured default; null: never switched off by batch size (vLLM's default).
    assert resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == (
        SpeculativeConfig("ngram", 3, 5, 5, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    )
    never = resolve_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    )
    assert never.disable_by_batch_size is None
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        resolve_speculative_config(
            {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
        )
    suffix = resolve_speculative_config({"method": "suffix"})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24


def test_draft_model_fields() -> None:
    """A model that is not [ngram] is a draft model (vLLM's inference), with its own
    quantization; draft_tensor_parallel_size 1 is the only one."""
    config = resolve_speculative_config(
        {
            "model": "HuggingFaceTB/SmolLM2-135M",
            "num_speculative_tokens": 3,
            "quantization": "q8_0",
            "draft_tensor_parallel_size": 1,
        }
    )
    assert (config.method, config.model, config.quantization) == (
        "draft_model",
        "HuggingFaceTB/SmolLM2-135M",
        "q8_0",
    )
    assert config.drafts_by_model and config.num_speculative_tokens == 3
    assert not resolve_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2}
    ).drafts_by_model


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "the draft's model"),
        ({"model": "HuggingFaceTB/SmolLM2-135M"}, "num_speculative_tokens"),
        ({"method": "ngram", "model": "some/draft", "num_speculative_tokens": 2}, "model"),
        ({"method": "suffix", "quantization": "q8_0"}, "quantization"),
        (
            {"model": "some/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 0.2},
            "suffix_decoding_min_token_prob",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "block"},
            "rejection_sample_method",
        ),
    ],
)
def test_refused_naming_the_field(given: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        resolve_speculative_config(given)
    with pytest.raises(ValueError, match=named):  # LLM(...) checks at once
        EngineArgs(speculative_config=given)


def test_cli_flag_and_shorthands() -> None:
    parser = make_parser()
    ns = parser.parse_args(
        ["serve", "-sc", '{"method": "ngram", "prompt_lookup_max": 3}', "--spec-tokens", "4"]
    )
    args = EngineArgs.from_cli_args(ns)
    assert args.speculative_config == {
        "method": "ngram",
        "prompt_lookup_max": 3,
        "num_speculative_tokens": 4,
    }
    with pytest.raises(ValueError, match="spec_tokens and speculative_config"):
        EngineArgs(speculative_config={"num_speculative_tokens": 2}, spec_tokens=3)
    assert EngineArgs(speculative_config='{"method": "suffix"}').speculative_config == {
        "method": "suffix"
    }


@pytest.mark.parametrize(
    ("device_type", "given", "expected"),
    [
        ("cpu", {}, DEFAULT_DISABLE_BY_BATCH_SIZE),
        ("cuda", {}, None),  # measured on CPUs only: elsewhere vLLM's never
        ("cuda", {"disable_by_batch_size": 16}, 16),
        ("cpu", {"disable_by_batch_size": None}, None),
    ],
)
def test_the_batch_size_default_is_the_cpus(device_type, given, expected) -> None:
    from tests.model.tiny import tiny_model_config

    platform = PlatformInfo(f"{device_type}:0", device_type, "", 1 << 30, 8 << 30)
    spec = {"method": "ngram", "num_speculative_tokens": 3, **given}
    config = EngineArgs(speculative_config=spec, kv_cache_tokens=1024).create_engine_config(
        platform, tiny_model_config(), "m"
    )
    assert config.speculative.disable_by_batch_size == expected
