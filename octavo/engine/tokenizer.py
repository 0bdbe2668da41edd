"""Loads the tokenizer (and its chat template) that belongs to a model path, or the one
`--tokenizer` names instead (any of the same kinds of path).

GGUF files carry their vocabulary, merges and chat template in metadata; transformers builds a
fast tokenizer from them. Hugging Face folders use their own tokenizer files
(`tokenizer_config.json` or `chat_template.jinja`). A `--chat-template` override replaces the
model's template on the tokenizer itself, so every renderer (the server's chat and /tokenize,
`LLM.chat`, `octavo chat`) uses it without being told.
"""

from __future__ import annotations

import logging
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """`model_path` is a resolved model or tokenizer location: a .gguf file or a Hugging Face
    folder (a tokenizer's may hold only its tokenizer files); `chat_template` (template text,
    already read from its file) replaces the model's."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if model_path.endswith(".gguf"):
            folder, name = os.path.split(os.path.abspath(model_path))
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # transformers raises many types; one clear message for users
        raise ValueError(f"Could not load a tokenizer for {model_path!r}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(previous)
        hf_logging.enable_progress_bar()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
