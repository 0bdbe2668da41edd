"""PagedAttention: the attention step of one decoder layer over the paged KV cache.

Owns the order of operations: first every scheduled token's k and v go into the cache at
`slot_mapping`, then the backend attends from the cache. Writing all before reading matters:
two requests that share prefix blocks, scheduled in the same step, read keys the other has just
written in this same layer call. Projections and RoPE belong to the model, not here; which
implementation writes and attends is the backend's, given when the model is built.
"""

from __future__ import annotations

from torch import Tensor, nn

from octavo.model.backends.base import AttentionBackend, AttentionPlan


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """window: 0, or this layer's sliding window (each query sees its last `window`
        positions); softcap: 0, or the cap of its attention scores (Gemma 2)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.window = window
        self.softcap = softcap
        # The KV cache group whose plan this layer reads (set by the runner with groups).
        self.kv_group = 0

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, plan: AttentionPlan
    ) -> Tensor:
        """query: (num_tokens, num_heads, head_dim); key, value: (num_tokens, num_kv_heads,
        head_dim). Mutates kv_cache (this step's slots). Returns (num_tokens, num_heads *
        head_dim)."""
        if plan.groups:
            plan = plan.groups[self.kv_group]  # this layer's group: its blocks, its window
        elif self.window:
            plan = plan.windows[self.window]  # the step as this window sees it
        self.backend.write_kv_cache(kv_cache, key, value, plan.metadata.slot_mapping)
        output = self.backend.forward(
            query, key, value, kv_cache, plan, self.scale, self.window, self.softcap
        )
        return output.flatten(1, 2)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend.name}"
            + (f", window={self.window}" if self.window else "")
            + (f", softcap={self.softcap}" if self.softcap else "")
        )
