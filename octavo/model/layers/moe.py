"""SparseMoE: a mixture of gated-MLP experts with top-k softmax routing (Mixtral, Qwen2/3-MoE).

Each token's router logits (`gate`, hidden -> num_experts) become probabilities in float32;
the top k experts' probabilities, renormalised over those k where the config says so, weight
the outputs of those experts. The step's tokens are grouped by expert (one stable sort of the
(token, choice) pairs), so each expert that any token chose runs once, on all of its tokens,
and streams its weights once per step; nothing loops over tokens (a step of one token, a
single stream's decode, runs its k experts in turn instead, for fewer torch calls). The
contributions are summed per token in ascending expert order, as transformers sums them.
Qwen2-MoE adds a shared expert that every token runs, scaled by sigmoid(shared_expert_gate(x)).

Every expert is a GatedMLP with its own Linear layers, so each gets a weight format from the
backend like any dense layer (packed for the decode kernel, GGML blocks, dense) and the
checkpoint's per-expert tensors (`experts.N.gate_proj`, ...) load by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from octavo.model.backends.base import LayerOps
from octavo.model.layers.linear import Linear
from octavo.model.layers.mlp import GatedMLP


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        act: str,
        ops: LayerOps,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, False, act, ops) for _ in range(num_experts)
        )
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, act, ops)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, experts), each (num_tokens, top_k): the chosen experts by falling
        probability and their weights in x's dtype."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden)."""
        weights, experts = self.route(x)
        if x.shape[0] == 1:
            out = self._one_token(x, weights[0].tolist(), experts[0].tolist())
        else:
            out = self._grouped(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out += torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _one_token(self, x: Tensor, weights: list[float], experts: list[int]) -> Tensor:
        """A single-stream decode step: its k experts one after another, in ascending order
        (as the grouped path and transformers sum them), with a third of the grouped path's
        torch calls, which at one row cost more than the experts' matmuls."""
        out = None
        for expert, weight in sorted(zip(experts, weights, strict=True)):
            y = self.experts[expert](x).mul_(weight)
            out = y if out is None else out.add_(y)
        return out

    def _grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # Pairs (token, choice) sorted by expert, stable: within an expert, by token.
        choices = experts.flatten()
        order = choices.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        grouped = x[tokens]
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                outputs[rows] = self.experts[expert](grouped[rows])
                start += count
        outputs.mul_(weights.flatten()[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, outputs)
