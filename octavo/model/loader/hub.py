"""Hugging Face Hub ids (`org/name`): the local folder of a model repository's snapshot,
through huggingface_hub and its cache (HF_HOME / HF_HUB_CACHE, or a download_dir), offline
from the cache when HF_HUB_OFFLINE is set or the Hub cannot be reached, downloaded where it
can. Only what octavo reads is fetched: config and tokenizer files, safetensors weights and
their index, generation_config.json."""

from __future__ import annotations

import os
import re

from octavo.model.loader.errors import ModelLoadError

# What a checkpoint folder needs (loader/safetensors.py, engine/tokenizer.py); no .bin, .pt,
# .gguf or ONNX files.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# What a tokenizer needs (--tokenizer): the same without the weights.
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(model: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_REPO_ID.match(model)) and not os.path.exists(model)


def snapshot_folder(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    allow_patterns: list[str] | None = None,
    token: str | bool | None = None,
) -> str:
    """The local folder of `repo_id` at `revision` (a branch, tag or commit; default: main),
    from the cache or downloaded into it, with the files `allow_patterns` match (default:
    ALLOW_PATTERNS, what a model needs). `token` (vLLM's --hf-token) authorizes the download:
    a token, True for the one `hf auth login` stored, None for huggingface_hub's own choice
    (HF_TOKEN, else the stored one). Raises ModelLoadError saying what was tried."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=allow_patterns or ALLOW_PATTERNS,
            local_files_only=offline,
            token=token,
        )
    except LocalEntryNotFoundError:
        where = download_dir or "the Hugging Face cache"
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise ModelLoadError(
            f"Model {at!r} is not a local path, is not in {where}, and {why}."
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelLoadError(
            f"Model {at!r}: no such repository on the Hugging Face Hub, or it needs a token "
            f"(--hf-token or HF_TOKEN) it was not given ({type(exc).__name__})."
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"Model {repo_id!r} has no revision {revision!r}.") from None
