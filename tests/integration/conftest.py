"""Fixtures for engine tests on the embedded SmolLM2-135M-Instruct in float32.

Loading the GGUF and building its tokenizer takes seconds, so both are loaded once per session
and shared by every engine the tests build with the same backend choices (the model holds no
per-request state: the KV cache belongs to each engine's runner).
"""

from __future__ import annotations

import functools

import pytest

import octavo.engine.tokenizer as tokenizer_module
import octavo.worker.setup as setup_module
from octavo import LLM
from octavo.model.parallel import TRIVIAL


def _shared_load_model():
    """load_model, once per path and backend choice: a later engine with the same choices gets
    the model built first, and its backend the first one's record of what it prepared."""
    load_model = setup_module.load_model
    loaded = {}

    def load(path, backend, quantization=None, tp=TRIVIAL, hf_config=None, embed=False):
        # a rank's share, a changed config or a pooling model is its own
        if tp.size > 1 or hf_config or embed:
            return load_model(path, backend, quantization, tp, hf_config, embed)
        key = (
            path,
            quantization,
            backend.dtype,
            backend.kv_cache_dtype,
            backend.attention.name,
            backend.ops.name,
            backend.kernels,
            backend.calibration.fixed_rows if backend.calibration else None,
        )
        if key not in loaded:
            loaded[key] = load_model(path, backend, quantization), backend
        result, first = loaded[key]
        backend.weights_report, backend.fused_decode_layer = (
            first.weights_report,
            first.fused_decode_layer,
        )
        return result

    return load


@pytest.fixture(scope="session", autouse=True)
def _share_weights_and_tokenizer():
    patch = pytest.MonkeyPatch()
    patch.setattr(setup_module, "load_model", _shared_load_model())
    patch.setattr(
        tokenizer_module, "load_tokenizer", functools.lru_cache(tokenizer_module.load_tokenizer)
    )
    yield
    patch.undo()


@pytest.fixture(scope="session")
def make_llm():
    """Build an LLM on the embedded model in float32; settings default to a roomy pool of
    16-token blocks (short test prompts then span several, for prefix caching and preemption;
    the CPU default is 128)."""

    def make(**overrides) -> LLM:
        settings = dict(
            dtype="float32", max_model_len=512, kv_cache_tokens=8192, block_size=16, seed=0
        )
        settings.update(overrides)
        return LLM(**settings)

    return make


@pytest.fixture(scope="session")
def llm(make_llm) -> LLM:
    return make_llm()
