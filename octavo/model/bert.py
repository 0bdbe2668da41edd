"""BERT (transformers' BertModel, and sentence-transformers' BERT checkpoints): an encoder,
reading like HF's modeling_bert.

Embeddings (word + absolute position + token type 0, then LayerNorm) / SelfAttention /
Layer (post-LN: attention, add, LayerNorm; GELU MLP, add, LayerNorm) / Model, over the same flat
batch as the decoders: (num_tokens,) ids and positions of every scheduled request, no padding.
Attention is bidirectional within each request and never reads the paged KV cache: a request's
whole prompt runs in one step (the engine schedules encoder prompts whole), so the rows of
request i are all the keys it attends to (AttentionMetadata.query_start_loc). That plain-torch
softmax(QK^T)V per request is the only attention path, so it is its own reference. The output
is the last layer's hidden states (the "final-norm" states a pooler reads); BERT's own pooler
(dense + tanh, for next-sentence prediction) is not built and its weights are ignored, as
sentence-transformers ignores them. Knows nothing of requests or scheduling.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from octavo.model.backends import ModelBackend
from octavo.model.backends.base import AttentionPlan
from octavo.model.config import ModelConfig
from octavo.model.layers.linear import Linear
from octavo.model.layers.weights import load_checkpoint_weights

# Checkpoint tensors an encoder for embeddings has no use for: BERT's pooler and the
# pre-training heads of BertForPreTraining / BertForMaskedLM checkpoints.
_UNUSED_PREFIXES = ("pooler.", "cls.")


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(
            max(config.type_vocab_size, 1), config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        # Every token is of type 0 (one segment), as sentence-transformers encodes one text.
        embeddings = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(embeddings)  # (num_tokens, hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = Linear(config.hidden_size, config.q_size)
        self.key = Linear(config.hidden_size, config.q_size)
        self.value = Linear(config.hidden_size, config.q_size)

    def forward(self, hidden_states: Tensor, query_start_loc: list[int]) -> Tensor:
        num_tokens = hidden_states.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q = self.query(hidden_states).view(shape).transpose(0, 1)  # (heads, tokens, head_dim)
        k = self.key(hidden_states).view(shape).transpose(0, 1)
        v = self.value(hidden_states).view(shape).transpose(0, 1)
        out = torch.empty_like(q)
        scale = self.head_dim**-0.5
        # Each request attends to all of its own tokens and to no other request's.
        for start, end in itertools.pairwise(query_start_loc):
            scores = (q[:, start:end] @ k[:, start:end].transpose(1, 2)) * scale
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            out[:, start:end] = probs @ v[:, start:end]
        return out.transpose(0, 1).reshape(num_tokens, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(config.q_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: Tensor, query_start_loc: list[int]) -> Tensor:
        return self.output(self.self(hidden_states, query_start_loc), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        # BERT's "gelu" is the exact (erf) GELU.
        return nn.functional.gelu(self.dense(hidden_states))


class BertOutput(BertSelfOutput):
    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.dense = Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: Tensor, query_start_loc: list[int]) -> Tensor:
        attention_output = self.attention(hidden_states, query_start_loc)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder as an embedding model: forward returns hidden states, no logits."""

    def __init__(self, config: ModelConfig, backend: ModelBackend) -> None:
        super().__init__()
        if config.hidden_act != "gelu":
            raise ValueError(f"BertModel with hidden_act={config.hidden_act!r}: only gelu is.")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_plan: AttentionPlan,
        output_rows: Tensor | None = None,
    ) -> Tensor:
        """As the decoders' forward (model/llama.py), except that `kv_caches` are not read or
        written: every scheduled request must be whole in this step. Returns the last layer's
        hidden states, (num_tokens, hidden) or only `output_rows`."""
        metadata = attn_plan.metadata
        if any(
            seq_len != query_len
            for seq_len, query_len in zip(metadata.seq_lens, metadata.query_lens)
        ):
            raise ValueError("an encoder runs each prompt whole, in one step")
        hidden_states = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden_states = layer(hidden_states, metadata.query_start_loc)
        return hidden_states if output_rows is None else hidden_states[output_rows]

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        raise ValueError("BertModel is an encoder: it has no language-model head to sample.")

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """HF BertModel tensor names (a `bert.` prefix, as BertForMaskedLM writes, is
        dropped); the pooler, the pre-training heads and position_ids buffers are ignored."""

        def renamed() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("bert.")
                if name.startswith(_UNUSED_PREFIXES) or name.endswith("position_ids"):
                    continue
                # transformers before 4.x named LayerNorm weights gamma / beta.
                name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
                yield name.replace("LayerNorm.beta", "LayerNorm.bias"), tensor

        with torch.no_grad():
            load_checkpoint_weights(self, renamed(), {})
