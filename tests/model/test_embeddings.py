"""Pooling models offline: a decoder as an embedder (last-token or mean pooling, normalized or
not) against transformers' hidden states, batched, chunked and prefix-cached; the runner /
convert / pooler resolution (sentence-transformers folders included); what a generation model
and a pooling model refuse."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from octavo import LLM, PoolingParams
from octavo.config import EngineArgs

from .test_families_engine import _save_tokenizer
from .tiny import TINY_SHAPE, save_tiny_checkpoint

SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4, max_model_len=64)
# Prompts of different lengths; the first is longer than the chunked engine's step budget.
PROMPTS = [
    [5, 9, 33, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [40, 41, 42],
    [200, 3, 45, 7, 77, 1],
]


def _save_bare_model(folder, model_type: str) -> torch.nn.Module:
    """A tiny transformers AutoModel (the bare decoder, as embedding checkpoints are saved:
    architectures `Qwen3Model`, no lm_head, no `model.` prefix), weights as tiny.py draws
    them, saved with a tokenizer."""
    config = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[model_type](
        **TINY_SHAPE
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.eval().save_pretrained(folder)
    _save_tokenizer(folder)
    return model


def _hidden(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), hidden) final-norm hidden states of transformers' model."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).last_hidden_state[0].float()


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    torch.testing.assert_close(got_t, want, rtol=1e-4, atol=1e-5)


def _assert_pool_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embed")
    return folder, _save_bare_model(folder, "qwen3")


def test_last_token_embeddings_match_transformers_batched_and_chunked(qwen3_embedder) -> None:
    """Qwen3-Embedding style: a bare Qwen3Model is a pooling model by default, pooling the
    last token, normalized; several prompts of different lengths in one call, one of them
    longer than the step budget (chunked prefill), and every block back in the pool."""
    folder, hf = qwen3_embedder
    llm = LLM(str(folder), max_num_batched_tokens=8, long_prefill_token_threshold=8, **SETTINGS)
    config = llm.llm_engine.config
    assert (config.runner, config.convert, config.pooler.pooling_type) == (
        "pooling",
        "none",
        "LAST",
    )
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == prompt
        want = torch.nn.functional.normalize(_hidden(hf, prompt)[-1], dim=-1)
        _assert_close(output.outputs.embedding, want)
    _assert_pool_free(llm)
    # Unnormalized, per request.
    raw = llm.embed(PROMPTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    _assert_close(raw.outputs.embedding, _hidden(hf, PROMPTS[1])[-1])
    # The same prompt again hits the prefix cache (LAST pooling may) and pools the same.
    again = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    _assert_close(again.outputs.embedding, torch.tensor(outputs[0].outputs.embedding))
    _assert_pool_free(llm)


def test_mean_pooling_of_a_converted_causal_lm(tmp_path) -> None:
    """--convert embed over a LlamaForCausalLM checkpoint, --pooler-config MEAN without
    normalization: the mean of transformers' final hidden states, chunked, and never from
    prefix-cache hits (every position's state is read)."""
    hf = save_tiny_checkpoint(tmp_path, "llama")
    _save_tokenizer(tmp_path)
    llm = LLM(
        str(tmp_path),
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "use_activation": False},
        max_num_batched_tokens=8,
        long_prefill_token_threshold=8,
        **SETTINGS,
    )
    assert llm.llm_engine.config.convert == "embed"
    for _ in range(2):  # the second time would find the prompts cached
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            assert output.num_cached_tokens == 0
            _assert_close(output.outputs.embedding, _hidden(hf.model, prompt).mean(dim=0))
    _assert_pool_free(llm)


def test_sentence_transformers_folder_sets_the_pooler(qwen3_embedder, tmp_path) -> None:
    """modules.json with a Pooling module (mean) and no Normalize: vLLM's reading of a
    sentence-transformers folder gives MEAN pooling without normalization."""
    folder, hf = qwen3_embedder
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    llm = LLM(str(tmp_path), **SETTINGS)
    pooler = llm.llm_engine.config.pooler
    assert (pooler.pooling_type, pooler.use_activation, pooler.source) == (
        "MEAN",
        False,
        "sentence_transformers",
    )
    output = llm.embed(PROMPTS[2], use_tqdm=False)[0]
    _assert_close(output.outputs.embedding, _hidden(hf, PROMPTS[2]).mean(dim=0))


def test_refusals(qwen3_embedder, tmp_path) -> None:
    folder, _ = qwen3_embedder
    llm = LLM(str(folder), **SETTINGS)
    with pytest.raises(ValueError, match="only supported for generative models"):
        llm.generate([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([[5, 6]], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(TypeError):
        PoolingParams(normalize=False)  # vLLM removed it too (use_activation)
    # A prompt may fill max_model_len: nothing is generated after it.
    assert len(llm.embed([[7] * 64], use_tqdm=False)[0].outputs.embedding) == 64
    _assert_pool_free(llm)
    with pytest.raises(ValueError, match="use_activation"):
        EngineArgs(model=str(folder), pooler_config={"normalize": False})
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(model=str(folder), pooler_config={"pooling_type": "STEP"})
    save_tiny_checkpoint(tmp_path, "llama")
    _save_tokenizer(tmp_path)
    generator = LLM(str(tmp_path), **SETTINGS)
    assert generator.llm_engine.config.runner == "generate"
    with pytest.raises(ValueError, match="Embedding API is not supported"):
        generator.embed([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(folder), runner="generate", **SETTINGS)


def test_matryoshka_dimensions(qwen3_embedder, tmp_path) -> None:
    """A config with matryoshka_dimensions: a request's `dimensions` keeps that prefix, then
    normalizes (vLLM's order); any other length is refused naming dimensions."""
    folder, hf = qwen3_embedder
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), **SETTINGS)
    output = llm.embed(PROMPTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0]
    want = torch.nn.functional.normalize(_hidden(hf, PROMPTS[1])[-1][:16], dim=-1)
    _assert_close(output.outputs.embedding, want)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(PROMPTS[1], PoolingParams(dimensions=20), use_tqdm=False)
