"""Pooling: a model's final-norm hidden states -> one vector per prompt (embeddings).

vLLM's sequence poolers, as plain torch over the hidden states a request's prompt positions
produced: LAST (the last position's state), MEAN (the mean over every position), CLS (the
first position's). A pooled vector may keep only its first `dimensions` values (Matryoshka
models) and is then L2-normalized where asked (the embed task's activation), in that order,
as vLLM does. Also the conversion of a causal LM into an embedder (vLLM's `--convert embed`):
its language-model head is dropped and a bare `*Model` checkpoint's tensor names get the
decoder's `model.` prefix. Knows nothing of requests: the runner gathers each request's rows,
across its prompt chunks, and calls `finish_pooling`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def finish_pooling(pooled: Tensor, dimensions: int | None, normalize: bool) -> Tensor:
    """(hidden,) float32 pooled state -> the embedding: its first `dimensions` values (None:
    all), L2-normalized where `normalize`."""
    if dimensions is not None:
        pooled = pooled[:dimensions]
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled


def as_embedding_model(model: nn.Module) -> nn.Module:
    """A causal LM built for its hidden states only: its lm_head (if any) is dropped, so the
    checkpoint's is ignored and none is required (the LM classes skip `lm_head.weight` when
    they have no head)."""
    if hasattr(model, "lm_head"):
        model.lm_head = None
    return model


def embedding_weights(
    weights: Iterable[tuple[str, Tensor]], prefix: str = "model."
) -> Iterator[tuple[str, Tensor]]:
    """A checkpoint's tensors as the decoder class names them: a bare `*Model` checkpoint's
    `layers.0...` is `model.layers.0...` (names that have the prefix keep it), and the
    language-model head, which an embedder does not use, is left out."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith(prefix) else prefix + name), tensor
