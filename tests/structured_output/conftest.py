"""Fixtures for structured-output tests: the embedded model's real tokenizer (its vocabulary is
what llguidance compiles against), a manager over it, and an offline LLM whose model is a tiny
random 2-layer Llama with that same vocabulary, so the whole engine path (scheduler, manager,
runner mask, sampler) runs in milliseconds per step without loading the real weights.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from octavo import LLM
from octavo.engine.tokenizer import load_tokenizer
from octavo.model.loader import find_default_model
from octavo.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 2


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(find_default_model())


@pytest.fixture(scope="session")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, len(tokenizer), (EOS_TOKEN_ID,))


def tiny_llm_folder(tokenizer, folder):
    """A tiny random 2-layer Llama over `tokenizer`'s vocabulary, saved with it to `folder`."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tokenizer, tmp_path_factory) -> LLM:
    folder = tiny_llm_folder(tokenizer, tmp_path_factory.mktemp("tiny-llama"))
    return LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_tokens=4096, seed=0)
