"""vLLM's launch surface: every flag of `vllm serve` (octavo/entrypoints/vllm_flags.json, from
vLLM's own parser) parses, and is octavo's own flag or held to one disposition, with what the
user is told; values parse as vLLM parses them; `LLM(...)` takes vLLM's keywords the same way."""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

import pytest

from octavo.config import EngineArgs, PlatformInfo, human_readable_int
from octavo.entrypoints.cli import expand_config_file, main, make_parser, subparser
from octavo.entrypoints.vllm_compat import (
    DISPOSITIONS,
    GROUP_DEFAULTS,
    NO_EFFECT,
    REFUSED,
    VllmFlagRefused,
    check_keywords,
    check_namespace,
    disposition,
    vllm_flags,
    vllm_version,
)


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    return subparser(make_parser(), "serve")


@functools.cache
def own_options() -> frozenset[str]:
    """octavo's own serve flags (not the ones vllm_compat adds)."""
    return frozenset(
        option
        for action in serve_parser()._actions
        if not action.dest.startswith("vllm_compat__")
        for option in action.option_strings
    )


def sample_argv(flag: dict) -> list[str]:
    """The flag given once, with a value of the kind it takes."""
    option = flag["options"][0]
    if flag["nargs"] == 0:
        return [option]
    own = next((a for a in serve_parser()._actions if option in a.option_strings), None)
    if own is not None and own.metavar == "JSON":
        return [option, "{}"]  # octavo's dict-valued flags parse their JSON object
    choices = list(own.choices) if own is not None and own.choices else flag["choices"]
    value = str(choices[0]) if choices else "1"
    return [option, value]


def test_the_flag_list_is_vllms_own():
    flags = vllm_flags()
    assert vllm_version().startswith("0.32")
    assert len(flags) > 300
    names = {option for flag in flags for option in flag["options"]}
    for option in ("--gpu-memory-utilization", "--tensor-parallel-size", "-tp", "--max-model-len"):
        assert option in names


def test_every_vllm_flag_is_ours_or_has_one_disposition():
    own = own_options()
    counts = {"octavo": 0, NO_EFFECT: 0, REFUSED: 0, "some values": 0}
    for flag in vllm_flags():
        is_own = any(option in own for option in flag["options"])
        listed = DISPOSITIONS.get(flag["dest"])
        if is_own:
            assert listed is None, f"{flag['options'][0]} is octavo's own and listed as well"
            counts["octavo"] += 1
            continue
        verdict = disposition(flag)
        assert verdict is not None, f"{flag['options'][0]} ({flag['group']}) has no disposition"
        assert verdict.reason
        counts["some values" if verdict.accepts else verdict.kind] += 1
    assert sum(counts.values()) == len(vllm_flags())
    assert not set(DISPOSITIONS) - {flag["dest"] for flag in vllm_flags()}, "stale entries"
    assert set(GROUP_DEFAULTS) <= {flag["group"] for flag in vllm_flags()}
    # The README's table states these counts.
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for row, key in (
        ("octavo's own, vLLM's meaning", "octavo"),
        ("taken at the values octavo's behaviour has", "some values"),
        ("no effect here", NO_EFFECT),
        ("refused", REFUSED),
    ):
        assert f"| {row} | {counts[key]} |" in readme, (row, counts[key])


@pytest.mark.parametrize("flag", vllm_flags(), ids=lambda f: f["options"][0])
def test_each_vllm_flag_parses_and_says_what_it_does(flag):
    """Never "unrecognized arguments": each flag parses with a value of its kind; a flag that
    is not octavo's own either passes silently (a value octavo's behaviour has anyway), is
    logged as having no effect with the reason, or is refused naming itself and the issue."""
    argv = sample_argv(flag)
    ns = serve_parser().parse_args(argv)
    if any(option in own_options() for option in flag["options"]):
        return
    verdict = disposition(flag)
    try:
        notes = check_namespace(ns)
    except VllmFlagRefused as exc:
        assert verdict.kind == REFUSED
        assert argv[0] in str(exc) and verdict.reason in str(exc)
        return
    if verdict.accepts is not None:
        assert notes == []  # the sample value is one it takes
    else:
        assert verdict.kind == NO_EFFECT
        assert notes == [f"{' '.join(argv)} has no effect here: {verdict.reason}"]


def test_every_spelling_of_every_vllm_flag_is_known():
    """Each option string vLLM's parser has (aliases such as -tp, and the --no-X of its
    boolean flags) is one octavo's serve parser knows."""
    known = serve_parser()._option_string_actions
    unknown = [o for flag in vllm_flags() for o in flag["options"] if o not in known]
    assert unknown == []


def test_parallel_sizes_of_one_pass_and_more_are_refused_naming_the_issue():
    assert check_namespace(serve_parser().parse_args(["-tp", "1", "-pp", "1", "-dp", "1"])) == []
    with pytest.raises(
        VllmFlagRefused, match=r"--pipeline-parallel-size 2: not supported.*process layout"
    ):
        check_namespace(serve_parser().parse_args(["--pipeline-parallel-size", "2"]))
    with pytest.raises(VllmFlagRefused, match="--no-enable-chunked-prefill: not supported"):
        check_namespace(serve_parser().parse_args(["--no-enable-chunked-prefill"]))
    assert check_namespace(serve_parser().parse_args(["--enable-chunked-prefill"])) == []


def test_refused_flags_stop_the_server_with_one_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-transfer-config", "{}", "--enable-lora"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-transfer-config {}: not supported (KV transfer" in err
    assert "--enable-lora: not supported (LoRA adapters" in err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("4k", 4000),
        ("4K", 4096),
        ("25.6k", 25600),
        ("1G", 1 << 30),
        ("2m", 2 * 10**6),
    ],
)
def test_integers_parse_as_vllm_parses_them(text, value):
    assert human_readable_int(text) == value


def test_vllm_value_syntax_of_octavos_flags():
    ns = serve_parser().parse_args(
        [
            *("--max-model-len", "4k", "--kv-cache-memory-bytes", "1G", "--dtype", "half"),
            *("-q", "q8_0", "--api-key", "a", "b", "--served-model-name", "x", "y"),
        ]
    )
    args = EngineArgs.from_cli_args(ns)
    assert (args.max_model_len, args.kv_cache_memory_bytes) == (4000, 1 << 30)
    assert (args.dtype, args.quantization) == ("float16", "q8_0")
    assert ns.api_key == ["a", "b"] and args.served_model_name == ["x", "y"]
    assert (
        EngineArgs.from_cli_args(
            serve_parser().parse_args(["--max-model-len", "auto"])
        ).max_model_len
        is None
    )
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--max-model-len", "1.5K"])  # no decimals with K


def test_a_yaml_config_file_of_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 9000\nmax-model-len: 2k\napi-key: [a, b]\nenable-prefix-caching: false\n"
        "tensor_parallel_size: 1\ntrust-remote-code: true\nhost: 0.0.0.0\n"
    )
    parser = make_parser()
    argv = expand_config_file(["serve", "m.gguf", "--config", str(path), "--port", "8001"], parser)
    assert argv[:2] == ["serve", "m.gguf"]
    ns = parser.parse_args(argv)
    assert (ns.model_tag, ns.port, ns.host, ns.max_model_len) == ("m.gguf", 8001, "0.0.0.0", 2000)
    assert ns.api_key == ["a", "b"] and ns.enable_prefix_caching is False
    assert check_namespace(ns) == [
        f"--trust-remote-code has no effect here: {DISPOSITIONS['trust_remote_code'].reason}"
    ]
    with pytest.raises(ValueError, match="yaml"):
        expand_config_file(["serve", "--config", str(tmp_path / "x.json")], parser)


def test_max_logprobs_parses_and_bounds_the_offline_api():
    from octavo.core.sampling_params import SamplingParams
    from octavo.engine.input_processor import InputProcessor

    assert EngineArgs.from_cli_args(serve_parser().parse_args([])).max_logprobs == 20
    assert (
        EngineArgs.from_cli_args(serve_parser().parse_args(["--max-logprobs", "-1"])).max_logprobs
        == -1
    )
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2)
    from tests.mock_engine import word_tokenizer

    processor = InputProcessor(word_tokenizer(), 64, 30, (2,), max_logprobs=5)
    processor.resolve_params(SamplingParams(logprobs=5), 4)
    with pytest.raises(ValueError, match="logprobs=6 is more than max_logprobs=5"):
        processor.resolve_params(SamplingParams(logprobs=6), 4)
    uncapped = InputProcessor(word_tokenizer(), 64, 30, (2,), max_logprobs=-1)
    uncapped.resolve_params(SamplingParams(logprobs=30), 4)  # the whole vocabulary


def test_llm_keywords_of_vllm_are_held_to_their_flags_dispositions(caplog):
    with caplog.at_level(logging.INFO):
        notes = check_keywords({"trust_remote_code": True, "pipeline_parallel_size": 1})
    assert notes == [
        f"trust_remote_code has no effect here: {DISPOSITIONS['trust_remote_code'].reason}"
    ]
    with pytest.raises(ValueError, match="pipeline_parallel_size 2: not supported"):
        check_keywords({"pipeline_parallel_size": 2})
    with pytest.raises(TypeError, match="no_such_keyword"):
        check_keywords({"no_such_keyword": 1})


@pytest.fixture
def tiny_model_config():
    from tests.model.tiny import tiny_model_config

    return tiny_model_config()


def _platform(total: int) -> PlatformInfo:
    return PlatformInfo("cpu", "cpu", "", default_kv_cache_bytes=1 << 30, total_memory_bytes=total)


def test_gpu_memory_utilization_gives_the_kv_cache_its_share_less_the_weights(tiny_model_config):
    total, weights = 8 << 30, 1 << 30
    config = EngineArgs(gpu_memory_utilization=0.5, block_size=16).create_engine_config(
        _platform(total), tiny_model_config, "m", weight_bytes=weights
    )
    block_bytes = config.cache.bytes_per_token * 16
    assert config.cache.num_blocks == (total // 2 - weights) // block_bytes
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1"):
        EngineArgs(gpu_memory_utilization=0.1).create_engine_config(
            _platform(total), tiny_model_config, "m", weight_bytes=weights
        )
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(gpu_memory_utilization=0.5, kv_cache_tokens=1024)


def test_the_weight_bytes_are_those_of_the_files_the_loader_reads(tmp_path):
    """What gpu_memory_utilization subtracts: a folder's safetensors, not a .bin twin beside."""
    from octavo.worker.setup import weight_file_bytes
    from tests.model.tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "llama", seed=1)
    safetensors = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 1000)
    assert weight_file_bytes(str(tmp_path)) == safetensors


def test_several_served_model_names(tiny_model_config):
    config = EngineArgs(
        served_model_name=["a", "b", "a"], kv_cache_tokens=1024
    ).create_engine_config(_platform(8 << 30), tiny_model_config, "m")
    assert (config.served_model_name, config.served_model_names) == ("a", ("a", "b"))


def test_tokenizer_and_generation_config_flags_parse_as_vllm_takes_them(tiny_model_config):
    ns = serve_parser().parse_args(
        [
            *("--tokenizer", "org/tok", "--tokenizer-revision", "v1"),
            *("--generation-config", "vllm"),
            *("--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 7}'),
        ]
    )
    args = EngineArgs.from_cli_args(ns)
    assert (args.tokenizer, args.tokenizer_revision) == ("org/tok", "v1")
    assert args.generation_config == "vllm"
    assert args.override_generation_config == {"temperature": 0.5, "max_new_tokens": 7}
    assert check_namespace(ns) == []
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--override-generation-config", "[1]"])
    with pytest.raises(ValueError, match="override_generation_config is not valid JSON"):
        EngineArgs(override_generation_config="{temperature: 1}")
    # LLM(...) takes vLLM's dict, or its JSON text.
    assert EngineArgs(override_generation_config='{"top_k": 3}').override_generation_config == {
        "top_k": 3
    }


def test_generation_defaults_come_from_the_source_with_the_overrides_on_top(tiny_model_config):
    """vLLM's get_diff_sampling_param: auto takes the model's generation_config.json, vllm none,
    a folder its own; overrides replace or add keys (max_new_tokens is max_tokens), null drops
    one. Only an override's or a folder's max_new_tokens caps a request's own max_tokens."""
    import dataclasses

    model = dataclasses.replace(
        tiny_model_config, sampling_defaults=(("max_tokens", 64), ("temperature", 0.6))
    )
    overrides = {"temperature": None, "top_p": 0.9, "max_new_tokens": 32, "unrelated": 1}

    def resolve(folder_defaults=None, **settings):
        config = EngineArgs(kv_cache_tokens=1024, **settings).create_engine_config(
            _platform(8 << 30), model, "m", generation_defaults=folder_defaults
        )
        return config.sampling_defaults, config.max_tokens_cap

    assert resolve() == ({"max_tokens": 64, "temperature": 0.6}, None)
    assert resolve(override_generation_config={"top_k": 5}) == (
        {"max_tokens": 64, "temperature": 0.6, "top_k": 5},
        None,
    )
    assert resolve(override_generation_config=overrides) == ({"max_tokens": 32, "top_p": 0.9}, 32)
    assert resolve(generation_config="vllm") == ({}, None)
    assert resolve(generation_config="vllm", override_generation_config={"top_k": 5}) == (
        {"top_k": 5},
        None,
    )
    folder = {"max_tokens": 16, "min_p": 0.1}
    assert resolve(folder, generation_config="gen") == (folder, 16)
    assert resolve({"min_p": 0.1}, generation_config="gen") == ({"min_p": 0.1}, None)
