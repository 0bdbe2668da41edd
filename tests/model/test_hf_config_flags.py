"""vLLM's --hf-token, --hf-overrides and --hf-config-path on a tiny random model: the token
reaches every Hub download, the overrides replace config.json keys before octavo reads them,
and the config can come from another folder or Hub id; a GGUF file, whose config is its
metadata, refuses the last two."""

from __future__ import annotations

import json

import huggingface_hub
import pytest

from octavo import LLM
from octavo.config import EngineArgs
from octavo.entrypoints.cli import engine_args_from, make_parser
from octavo.model.loader import (
    HFConfigSource,
    ModelLoadError,
    read_model_config,
    resolve_hf_config_path,
)
from octavo.model.loader.safetensors import apply_hf_overrides
from octavo.worker.setup import probe

from .test_families_engine import _save_tokenizer
from .tiny import make_tiny_hf_model, save_tiny_checkpoint, write_tiny_gguf

SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(folder, "llama", seed=5)  # max_position_embeddings 256
    _save_tokenizer(folder)
    return folder


def test_overrides_replace_config_keys_before_the_model_config_is_built(model_folder):
    own = read_model_config(str(model_folder))
    source = HFConfigSource(overrides={"rms_norm_eps": 1e-3, "max_position_embeddings": 48})
    changed = read_model_config(str(model_folder), source)
    assert (own.rms_norm_eps, own.max_position_embeddings) == (1e-6, 256)
    assert (changed.rms_norm_eps, changed.max_position_embeddings) == (1e-3, 48)
    # A sub-config's keys are replaced one by one; any other dict replaces the value whole.
    config = {"text_config": {"a": 1, "b": 2}, "rope_scaling": {"type": "linear", "factor": 2}}
    merged = apply_hf_overrides(config, {"text_config": {"b": 3}, "rope_scaling": {"factor": 4}})
    assert merged == {"text_config": {"a": 1, "b": 3}, "rope_scaling": {"factor": 4}}
    assert config["text_config"] == {"a": 1, "b": 2}


def test_an_engine_runs_by_the_overridden_config(model_folder):
    llm = LLM(str(model_folder), hf_overrides='{"max_position_embeddings": 48}', **SETTINGS)
    config = llm.llm_engine.config
    assert config.scheduler.max_model_len == 48  # the model's own 256 fits the pool too
    assert config.hf_overrides == {"max_position_embeddings": 48}
    assert llm.llm_engine.model_runner.model_config.max_position_embeddings == 48
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineArgs(hf_overrides=lambda config: config)


def test_the_config_can_come_from_another_folder(model_folder, tmp_path):
    other = tmp_path / "config"
    other.mkdir()
    config = json.loads((model_folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    assert (
        read_model_config(str(model_folder), HFConfigSource(str(other))).max_position_embeddings
        == 40
    )
    llm = LLM(str(model_folder), hf_config_path=str(other), **SETTINGS)
    assert llm.llm_engine.config.scheduler.max_model_len == 40
    assert llm.llm_engine.config.hf_config_path == str(other)
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        resolve_hf_config_path(str(tmp_path))


def test_a_hub_config_path_resolves_its_config_alone(model_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "c" * 40
    repo = tmp_path / "hub" / "models--org--config"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(
        (model_folder / "config.json").read_text()
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    folder = resolve_hf_config_path("org/config", download_dir=str(tmp_path / "hub"))
    assert folder.endswith(f"snapshots/{commit}")


def test_gguf_files_refuse_config_overrides(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_hf_model("llama", seed=1), "llama")
    path = str(tmp_path / "tiny.gguf")
    assert read_model_config(path).max_position_embeddings == 256
    for source in (HFConfigSource(overrides={"rms_norm_eps": 1e-3}), HFConfigSource(str(tmp_path))):
        with pytest.raises(ModelLoadError, match="GGUF file's config is read from its metadata"):
            read_model_config(path, source)


def test_the_hf_token_reaches_every_hub_download(model_folder, monkeypatch):
    """--hf-token goes to huggingface_hub with the model's, the tokenizer's and the config's
    snapshot; the flag alone means the stored token (True)."""
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["token"]))
        return str(model_folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    args = EngineArgs(
        model="org/model",
        tokenizer="org/tokenizer",
        hf_config_path="org/config",
        generation_config="org/generation",
        hf_token="hf_secret",
        **SETTINGS,
    )
    facts = probe(args)
    assert facts.model_path == str(model_folder)
    assert sorted(calls) == [
        ("org/config", "hf_secret"),
        ("org/generation", "hf_secret"),
        ("org/model", "hf_secret"),
        ("org/tokenizer", "hf_secret"),
    ]
    config = args.create_engine_config(facts.platform, facts.model_config, facts.model_path)
    assert "hf_secret" not in config.to_json()  # the resolved configuration never logs it


def test_the_flags_parse_as_vllms():
    def parsed(*argv):
        return engine_args_from(make_parser().parse_args(["serve", *argv]))

    assert parsed("--hf-token").hf_token is True
    assert parsed("--hf-token", "hf_abc").hf_token == "hf_abc"
    assert parsed().hf_token is None
    args = parsed("--hf-overrides", '{"rms_norm_eps": 0.001}', "--hf-config-path", "org/cfg")
    assert (args.hf_overrides, args.hf_config_path) == ({"rms_norm_eps": 0.001}, "org/cfg")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--hf-overrides", "[1]"])
