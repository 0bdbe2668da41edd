"""Hugging Face Hub ids resolve through huggingface_hub's cache: a cache the test fills itself
in the Hub's layout (models--org--name/refs, snapshots/COMMIT), read offline."""

from __future__ import annotations

import shutil

import pytest

from octavo import LLM, SamplingParams
from octavo.model.loader import ModelLoadError, read_model_config, resolve_model_path
from octavo.model.loader.hub import looks_like_repo_id

from .test_families_engine import _save_tokenizer
from .tiny import save_tiny_checkpoint

MAIN = "a" * 40
V1 = "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hub cache holding org/tiny at main (4 layers) and at tag v1 (2 layers)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit, layers in ((MAIN, 4), (V1, 2)):
        folder = repo / "snapshots" / commit
        save_tiny_checkpoint(folder, "llama", seed=3, num_hidden_layers=layers)
        _save_tokenizer(folder)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return cache


def test_repo_ids_are_told_from_paths(tmp_path, monkeypatch):
    assert looks_like_repo_id("Qwen/Qwen3-0.6B")
    assert not looks_like_repo_id("/abs/path") and not looks_like_repo_id("file.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    assert not looks_like_repo_id("org/local")  # an existing relative path stays a path


def test_hub_id_resolves_to_its_snapshot_offline(hub_cache):
    main = resolve_model_path("org/tiny", download_dir=str(hub_cache))
    assert main.endswith(f"snapshots/{MAIN}")
    assert read_model_config(main).num_hidden_layers == 4
    tagged = resolve_model_path("org/tiny", revision="v1", download_dir=str(hub_cache))
    assert read_model_config(tagged).num_hidden_layers == 2
    assert resolve_model_path("org/tiny", revision=V1, download_dir=str(hub_cache)) == tagged


def test_missing_models_say_what_was_tried(hub_cache):
    with pytest.raises(ModelLoadError, match="'org/absent'.*HF_HUB_OFFLINE is set"):
        resolve_model_path("org/absent", download_dir=str(hub_cache))
    with pytest.raises(ModelLoadError, match="org/tiny@v9"):
        resolve_model_path("org/tiny", revision="v9", download_dir=str(hub_cache))


def test_llm_serves_a_hub_id_as_its_folder(hub_cache, tmp_path):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings = dict(kv_cache_tokens=512, block_size=4, dtype="float32")
    from_hub = LLM("org/tiny", download_dir=str(hub_cache), revision="v1", **settings)
    folder = tmp_path / "copy"
    shutil.copytree(hub_cache / "models--org--tiny" / "snapshots" / V1, folder)
    from_folder = LLM(str(folder), **settings)
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    expected = from_folder.generate([prompt], params)[0].outputs[0].token_ids
    assert from_hub.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert from_hub.llm_engine.config.served_model_name == "org/tiny"
    # vLLM's LLM methods: the model's generation defaults, and the prefix cache emptied.
    assert from_hub.get_default_sampling_params() == from_hub.llm_engine.default_sampling_params()
    assert from_hub.reset_prefix_cache() is True
