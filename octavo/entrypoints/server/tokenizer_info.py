"""vLLM's GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's
configuration, as its tokenizer_config.json gives it, in JSON.

Owns turning the tokenizer's init arguments into JSON, in vLLM's shape: special tokens as
their text, paths of vocabulary files left out (they name files of this machine), anything
else that is not JSON as its text; `tokenizer_class` is the loaded tokenizer's class, and
`chat_template` the server's --chat-template where one is set.

Must not: load or change the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# init arguments that are paths of the tokenizer's own files, never configuration.
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")


def tokenizer_info(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """The /tokenizer_info body for `tokenizer` (a transformers tokenizer)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in _FILE_KEYS:
        config.pop(key, None)
    info = {str(key): _as_json(value) for key, value in config.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info


def _as_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _as_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_as_json(item) for item in value]
    content = getattr(value, "content", None)  # AddedToken: its text
    return content if isinstance(content, str) else str(value)
