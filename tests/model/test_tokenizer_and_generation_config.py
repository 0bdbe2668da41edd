"""vLLM's --tokenizer / --tokenizer-revision and --generation-config /
--override-generation-config, end to end on a tiny random model: the tokenizer (and its chat
template) comes from elsewhere than the model, and the sampling defaults of a request that
sets none come from the generation config the settings name."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from octavo import LLM, SamplingParams
from octavo.model.loader import ModelLoadError, read_generation_defaults, resolve_tokenizer_path

from .test_families_engine import _save_tokenizer
from .tiny import save_tiny_checkpoint

SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4, max_model_len=64)
MAIN = "a" * 40
V1 = "b" * 40


def _save_reversed_tokenizer(folder, chat_template: str | None = None) -> None:
    """Words t0..t255 as _save_tokenizer's, each to 255 - its number (ids 3..252 swap ends)."""
    vocab = {f"t{i}": 255 - i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t255"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t255", bos_token="t254", eos_token="t253"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(folder, "llama", seed=5)
    _save_tokenizer(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(temperature=0.7, top_p=0.8, max_new_tokens=6)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_the_tokenizer_and_its_chat_template_come_from_the_tokenizer_folder(model_folder, tmp_path):
    other = tmp_path / "tokenizer"
    _save_reversed_tokenizer(other, "{% for m in messages %}{{ m['content'] }} {% endfor %}t9")
    llm = LLM(str(model_folder), tokenizer=str(other), **SETTINGS)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    output = llm.generate("t5 t17", params)[0]
    assert output.prompt_token_ids == [250, 238]  # the model's own would give [5, 17]
    assert llm.llm_engine.config.tokenizer == str(other)
    chat = llm.chat([{"role": "user", "content": "t3"}], params)[0]
    assert chat.prompt_token_ids == [252, 246]  # "t3 t9" by the folder's template
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(model_folder), tokenizer=str(tmp_path / "absent"), **SETTINGS)


def test_a_hub_tokenizer_at_its_revision(model_folder, tmp_path, monkeypatch):
    """A Hub id resolves through the cache (offline) at --tokenizer-revision, without weights."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    repo = cache / "models--org--tok"
    _save_tokenizer(repo / "snapshots" / MAIN)
    _save_reversed_tokenizer(repo / "snapshots" / V1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    path = resolve_tokenizer_path("org/tok", "v1", str(cache))
    assert path.endswith(f"snapshots/{V1}")
    assert resolve_tokenizer_path("org/tok", None, str(cache)).endswith(f"snapshots/{MAIN}")
    llm = LLM(
        str(model_folder),
        tokenizer="org/tok",
        tokenizer_revision="v1",
        download_dir=str(cache),
        **SETTINGS,
    )
    assert llm.get_tokenizer().encode("t5", add_special_tokens=False) == [250]
    with pytest.raises(ModelLoadError, match="org/tok@v9"):
        resolve_tokenizer_path("org/tok", "v9", str(cache))


def test_override_generation_config_sets_the_defaults_of_requests_without_params(model_folder):
    llm = LLM(
        str(model_folder),
        override_generation_config={"temperature": 0.0, "max_new_tokens": 3},
        **SETTINGS,
    )
    # The model's top_p stays, its temperature and max_new_tokens are overridden (a greedy
    # SamplingParams then turns its top_p off, as vLLM's does).
    assert llm.llm_engine.config.sampling_defaults == {
        "max_tokens": 3,
        "temperature": 0.0,
        "top_p": 0.8,
    }
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    explicit = SamplingParams(temperature=0.0, top_p=0.8, max_tokens=3)
    expected = llm.generate(prompt, explicit)[0].outputs[0].token_ids
    assert len(expected) <= 3
    assert llm.generate(prompt)[0].outputs[0].token_ids == expected
    # Without overrides, the model's generation_config.json.
    assert llm.llm_engine.config.generation_config == "auto"


def test_generation_config_folder_or_none(model_folder, tmp_path):
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"top_k": 4, "max_new_tokens": 5, "do_sample": True})
    )
    assert read_generation_defaults(str(folder)) == {"top_k": 4, "max_tokens": 5}
    assert read_generation_defaults(str(folder / "generation_config.json"))["top_k"] == 4
    assert read_generation_defaults(str(tmp_path)) == {}  # a folder without one: none
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_generation_defaults(str(tmp_path / "absent"))
    llm = LLM(
        str(model_folder),
        generation_config=str(folder),
        override_generation_config='{"min_p": 0.05}',  # vLLM's JSON text, as on its CLI
        **SETTINGS,
    )
    config = llm.llm_engine.config
    assert config.sampling_defaults == {"top_k": 4, "max_tokens": 5, "min_p": 0.05}
    assert config.max_tokens_cap == 5  # a folder's max_new_tokens caps server requests
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (1.0, 4, 5)
