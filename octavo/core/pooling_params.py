"""PoolingParams: the per-request knobs of a pooling (embedding) request, with vLLM's names.

A pooling request runs its prompt only: the scheduler admits and chunks it like any prompt, it
is never decoded, and it ends (FINISHED_STOPPED) in the step that computes its last prompt
token, carrying the pooled vector instead of a token. Plain data, no torch: how the hidden
states are pooled (LAST, MEAN, CLS) is the model's pooler configuration, which the runner
holds; a request only says whether its vector is normalized and how many of its dimensions
it keeps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# vLLM's pooling tasks; octavo runs "embed" only (vLLM's classify, token_embed, token_classify
# and score need heads octavo has not built).
POOLING_TASKS = ("embed",)


@dataclass
class PoolingParams:
    # vLLM's: L2-normalize the pooled vector (the embed task's activation); None: the model's
    # pooler default (True unless its sentence-transformers modules have no Normalize).
    use_activation: bool | None = None
    # vLLM's: keep the first `dimensions` values of the vector (Matryoshka models only).
    dimensions: int | None = None
    # vLLM's task name; None is "embed".
    task: str | None = None
    # Set by the engine, not by users (vLLM's field): the request takes no prefix-cache hits,
    # because its pooling reads the hidden state of every prompt position (MEAN, CLS), and a
    # hit would skip computing those.
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in (None, *POOLING_TASKS):
            raise ValueError(
                f"task={self.task!r} is not supported: octavo's pooling runs the "
                f"{', '.join(POOLING_TASKS)} task."
            )
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a boolean, got {self.use_activation!r}.")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}.")

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)
