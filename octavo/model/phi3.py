"""Phi-3: the Llama decoder with q/k/v and gate/up fused in the checkpoint.

Its checkpoints hold `self_attn.qkv_proj` (q, k, v rows in that order) and `mlp.gate_up_proj`
(gate rows, then up), which is how octavo's packed modules hold them anyway; loading cuts each
into the shards the Llama modules expect (float tensors and GGML block rows alike). LongRoPE
is the shared RotaryEmbedding's (model/layers/rotary.py), the sliding window ModelConfig's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Tensor | QuantizedTensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(
        self, weights: Iterable[tuple[str, Tensor | QuantizedTensor]]
    ) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
        config = self.config
        fused = {
            "self_attn.qkv_proj": {
                "self_attn.q_proj": config.q_size,
                "self_attn.k_proj": config.kv_size,
                "self_attn.v_proj": config.kv_size,
            },
            "mlp.gate_up_proj": {
                "mlp.gate_proj": config.intermediate_size,
                "mlp.up_proj": config.intermediate_size,
            },
        }
        for name, tensor in weights:
            prefix, _, rest = name.rpartition(".layers.")
            layer, _, module_param = rest.partition(".")
            module, _, param = module_param.rpartition(".")
            shards = fused.get(module) if prefix else None
            if shards is None:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(shards.values()):
                raise ValueError(
                    f"tensor {name!r}: expected {sum(shards.values())} rows, got {tensor.shape[0]}."
                )
            start = 0
            for shard, rows in shards.items():
                yield f"{prefix}.layers.{layer}.{shard}.{param}", _rows(tensor, start, rows)
                start += rows


def _rows(tensor: Tensor | QuantizedTensor, start: int, rows: int) -> Tensor | QuantizedTensor:
    """Rows start .. start + rows of a float tensor or of GGML blocks (rows of whole blocks)."""
    if isinstance(tensor, QuantizedTensor):
        blocks = tensor.blocks[start : start + rows]
        return QuantizedTensor(blocks, tensor.qtype, (rows, tensor.shape[1]))
    return tensor[start : start + rows]
