"""Drafter: a draft model's proposals for speculative decoding (method draft_model).

The draft is a smaller model with the target's tokenizer, loaded by the same loader onto the
same backend (any weight format the engine loads). It keeps its own KV cache tensors over the
target's block ids: the block pool, the block tables and the prefix cache are the target's,
and a block's slots hold the draft's KV of the same tokens. That holds because the draft
computes every token the target computes, in the same step: the runner calls `propose` after
each step with, per scheduled request, the tokens of its chunk that are now known (a prompt
chunk whole; after a verification, the last token and the accepted proposals, not the
rejected ones, whose slots the next step overwrites in both caches). A prefix-cache hit on a
block is then a hit for the draft too.

For a request the scheduler asked proposals of (SchedulerOutput.num_lookahead_tokens), the
same forward also runs its newly emitted token, whose logits give the first proposal; each
further proposal is one more decode pass of the draft over the proposals so far. Proposals
are the draft's argmax: the proposal distribution is one-hot at the proposed token, so the
runner's verification (rejection_sampler.num_accepted_one_hot) keeps the target's
distribution exactly, greedy or not. The scheduler allocated the slots those passes write
(num_lookahead_tokens beyond the step's tokens), so no write lands outside the request's
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from octavo.config import CacheConfig, SpeculativeConfig
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends import ModelBackend
from octavo.model.config import ModelConfig
from octavo.model.kv_cache import allocate_kv_cache
from octavo.worker.input_batch import InputBatch


@dataclass(slots=True)
class DraftChunk:
    """One scheduled row's part in the draft's first pass: positions start..stop - 1 of its
    tokens, then num_drafts proposals after its token at stop - 1 (0: none)."""

    row: int
    start: int
    stop: int
    num_drafts: int


class Drafter:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        backend: ModelBackend,
        speculative: SpeculativeConfig,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.backend = backend
        self.device = backend.device
        self.block_size = cache_config.block_size
        self.vocab_size = model_config.vocab_size
        self.num_speculative_tokens = speculative.num_speculative_tokens
        self._num_blocks = cache_config.num_blocks
        self.kv_caches = self.allocate_kv_cache()

    def allocate_kv_cache(self) -> list[torch.Tensor]:
        """The draft's cache tensors: a slot for every slot of the target's pool (zeros)."""
        return allocate_kv_cache(
            self.model_config,
            self._num_blocks,
            self.block_size,
            self.backend.kv_cache_dtype,
            self.device,
            self.backend.huge_pages,
        )

    def propose(self, batch: InputBatch, chunks: list[DraftChunk]) -> dict[str, list[int]]:
        """Write the draft's KV of every chunk's tokens (batch.token_ids), then return the
        proposals of the rows with num_drafts > 0, by request id."""
        if not chunks:
            return {}
        drafting = [chunk for chunk in chunks if chunk.num_drafts > 0]
        last_rows: list[int] = []
        flat = 0
        for chunk in chunks:
            flat += chunk.stop - chunk.start
            if chunk.num_drafts > 0:
                last_rows.append(flat - 1)
        tokens = self._forward(
            batch,
            [(chunk.row, np.arange(chunk.start, chunk.stop, dtype=np.int64)) for chunk in chunks],
            [batch.token_ids[chunk.row, chunk.start : chunk.stop] for chunk in chunks],
            last_rows,
        )
        proposals = {chunk.row: [token] for chunk, token in zip(drafting, tokens, strict=True)}
        for step in range(1, max((chunk.num_drafts for chunk in drafting), default=0)):
            rows = [chunk for chunk in drafting if chunk.num_drafts > step]
            tokens = self._forward(
                batch,
                [
                    (chunk.row, np.asarray([chunk.stop - 1 + step], dtype=np.int64))
                    for chunk in rows
                ],
                [np.asarray(proposals[chunk.row][-1:], dtype=np.int64) for chunk in rows],
                list(range(len(rows))),
            )
            for chunk, token in zip(rows, tokens, strict=True):
                proposals[chunk.row].append(token)
        return {batch.rows[row].request_id: tokens for row, tokens in proposals.items()}

    def _forward(
        self,
        batch: InputBatch,
        rows: list[tuple[int, np.ndarray]],
        token_ids: list[np.ndarray],
        sample_indices: list[int],
    ) -> list[int]:
        """One draft forward over each row's positions (contiguous, ending its sequence so
        far), writing their KV; the argmax token at each flat index of `sample_indices`."""
        query_start_loc, seq_lens, slots = [0], [], []
        for row, positions in rows:
            block_ids = batch.block_table[row, positions // self.block_size].astype(np.int64)
            slots.append(block_ids * self.block_size + positions % self.block_size)
            query_start_loc.append(query_start_loc[-1] + len(positions))
            seq_lens.append(int(positions[-1]) + 1)
        row_ids = [row for row, _ in rows]
        max_blocks = -(-max(seq_lens) // self.block_size)
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=self._to_device(np.concatenate(slots)),
            block_table=self._to_device(batch.block_table[row_ids, :max_blocks]),
            block_size=self.block_size,
        )
        plan = self.backend.attention.plan_step(metadata, self.model_config.attention_windows)
        hidden = self.model(
            self._to_device(np.concatenate(token_ids).astype(np.int64)),
            self._to_device(np.concatenate([positions for _, positions in rows])),
            self.kv_caches,
            plan,
            self._to_device(np.asarray(sample_indices, dtype=np.int64)),
        )
        if not sample_indices:
            return []
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
        return logits.argmax(dim=-1).tolist()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
