"""The interfaces a model backend fills: LayerOps, AttentionBackend and the AttentionPlan.

A backend is chosen once per engine (select.py) and handed to the model when it is built: each
layer keeps the ops it calls, so no layer asks at run time which implementation to use. Every
implementation has a plain-torch reference behind the same interface (TorchOps,
ReferenceAttention) that the tests compare it with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.kv_cache import write_kv_cache


class LayerOps(ABC):
    """The small ops around the matmuls. Inputs are in the model's compute dtype; results too."""

    name: str = ""

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x: (num_tokens, hidden) -> weight * x / rms(x), a new tensor; the mean of squares in
        float32 whatever x's dtype, cast back before the weight (as HF computes it)."""

    @abstractmethod
    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(x + residual), x + residual). Both inputs are consumed: their storage may
        hold the results."""

    @abstractmethod
    def rms_norm_heads(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """rms_norm over the last dim of (num_tokens, num_heads, head_dim), x possibly a view
        into a wider projection; returns a new tensor."""

    @abstractmethod
    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x * cos + rotate_half(x) * sin for x (num_tokens, num_heads, head_dim) with unit
        stride in head_dim (it may be a view into a projection), cos, sin (num_tokens,
        head_dim). May rotate x in place; returns the rotated tensor either way."""

    @abstractmethod
    def act_and_mul(self, act: str) -> Callable[[Tensor], Tensor]:
        """The function gate_up (num_tokens, 2 * inter), gate columns first -> act(gate) * up
        (num_tokens, inter), for HF's hidden_act name `act`. Raises ValueError for an
        activation this backend does not have."""

    def act_and_mul_rounds_once(self, act: str) -> bool:
        """Whether act_and_mul(act) also takes a bfloat16 gate_up, computes in float32 and
        rounds the result once to bfloat16: what rounding a float32 result for a bfloat16
        GEMM gives, so a feed-forward may keep the activations in bfloat16 between its two
        GEMMs (layers/mlp.py)."""
        return False


@dataclass(slots=True)
class AttentionPlan:
    """What one forward's attention needs beyond the tensors: the step's metadata, plus
    whatever the backend derived from it once for all layers (subclasses). Plain data.
    `windows`: the plan of each sliding window the model's layers use, over the metadata
    cut to the blocks that window can see (AttentionMetadata.for_window)."""

    metadata: AttentionMetadata
    windows: dict[int, AttentionPlan] = field(default_factory=dict)
    # With KV cache groups: each group's plan (over its own block table and slots, cut for
    # its window), indexed by group; the attention layers of group g use groups[g].
    groups: list[AttentionPlan] = field(default_factory=list)


class AttentionBackend(ABC):
    """Paged attention over the KV cache: plan once per forward, then per layer write and
    attend. kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim) (model/kv_cache.py)."""

    name: str = ""

    def choices(self) -> dict[str, str]:
        """What this backend chose beyond its name, for the start-up configuration."""
        return {}

    @abstractmethod
    def plan(self, metadata: AttentionMetadata, window: int = 0) -> AttentionPlan:
        """Everything derived from the step's metadata that every layer would otherwise repeat
        (index tensors, masks, kernel arguments); for layers with a sliding `window`, given
        the metadata cut for it."""

    def plan_step(
        self, metadata: AttentionMetadata, windows: tuple[int, ...] = ()
    ) -> AttentionPlan:
        """The plan of one forward, with one plan per sliding window of the model's layers
        (`windows`). Called once per forward, by the runner."""
        plan = self.plan(metadata)
        for window in windows:
            plan.windows[window] = self.plan(metadata.for_window(window), window)
        return plan

    def plan_groups(
        self, metadata: list[AttentionMetadata], windows: tuple[int, ...]
    ) -> AttentionPlan:
        """The plan of one forward over KV cache groups: group g's metadata (its block table
        and slots) planned for its window; the first group's plan holds them all."""
        plans = [
            self.plan(m.for_window(w), w) if w else self.plan(m)
            for m, w in zip(metadata, windows, strict=True)
        ]
        plans[0].groups = plans
        return plans[0]

    def write_kv_cache(
        self, kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
    ) -> None:
        """Store key, value (num_tokens, num_kv_heads, head_dim) at their slots, converting to
        the cache dtype. This default is the plain torch write (kv_cache.write_kv_cache)."""
        write_kv_cache(kv_cache, key, value, slot_mapping)

    @abstractmethod
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        plan: AttentionPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Tensor:
        """query: (num_tokens, num_heads, head_dim); key, value: this step's (num_tokens,
        num_kv_heads, head_dim), already written to kv_cache. Returns (num_tokens, num_heads,
        head_dim) in query's dtype. Must not write to the cache. window > 0: a query sees only
        the last `window` positions up to its own (transformers' sliding window), and `plan` is
        that window's; softcap > 0: scores become softcap * tanh(score / softcap) before the
        mask and softmax (Gemma 2)."""
