"""AttentionMetadata: where each request's tokens sit in the flat batch and in the paged cache.

Plain data. The runner fills in five fields per forward; the few plain values every backend
needs (query lengths, the longest query and sequence) are derived once in `__post_init__`, and
the inputs are checked there. Python ints stay on the host so that no backend needs a
device-to-host sync to learn a shape. What a backend derives beyond that (index tensors, masks,
kernel arguments) is its `plan()` (model/backends/). This module knows nothing of requests beyond
their index in the batch.

A request i with query_len q_i and seq_len s_i (tokens in the cache after this step's writes):

    cache positions    0 ............ s_i - q_i - 1 | s_i - q_i .......... s_i - 1
                       computed before this step    | this step's tokens (rows of the batch)
    query row j (0 <= j < q_i) sits at position s_i - q_i + j and sees keys 0 .. s_i - q_i + j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    # Request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1] of the flat batch.
    query_start_loc: list[int]  # (num_reqs + 1,)
    # Tokens of request i in the cache after this step's writes (computed before + scheduled now).
    seq_lens: list[int]  # (num_reqs,)
    slot_mapping: Tensor  # (num_tokens,) int64: slot = block_id * block_size + offset
    block_table: Tensor  # (num_reqs, max_blocks_per_req) int32, request i's block ids, 0-padded
    block_size: int

    # Derived, never passed in.
    num_reqs: int = field(init=False)
    num_tokens: int = field(init=False)
    query_lens: list[int] = field(init=False)
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)
    # Every request has one query token (a decode): the whole batch is decodes.
    is_all_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.num_reqs = len(self.seq_lens)
        self.query_lens = [
            self.query_start_loc[i + 1] - self.query_start_loc[i] for i in range(self.num_reqs)
        ]
        self.num_tokens = self.query_start_loc[-1] if self.query_start_loc else 0
        self.max_query_len = max(self.query_lens, default=0)
        self.max_seq_len = max(self.seq_lens, default=0)
        self.is_all_decode = self.max_query_len == 1
        self._validate()

    def _validate(self) -> None:
        if len(self.query_start_loc) != self.num_reqs + 1 or self.query_start_loc[0] != 0:
            raise ValueError(
                f"query_start_loc must be [0, ...] with num_reqs + 1 = {self.num_reqs + 1} "
                f"entries, got {self.query_start_loc}."
            )
        for i, (q_len, s_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            if not 1 <= q_len <= s_len:
                raise ValueError(f"request {i}: need 1 <= query_len={q_len} <= seq_len={s_len}.")
        if tuple(self.slot_mapping.shape) != (self.num_tokens,):
            raise ValueError(
                f"slot_mapping shape {tuple(self.slot_mapping.shape)} != ({self.num_tokens},)."
            )
        rows, cols = self.block_table.shape
        if rows < self.num_reqs or cols * self.block_size < self.max_seq_len:
            raise ValueError(
                f"block_table shape {(rows, cols)} cannot hold {self.num_reqs} requests of up "
                f"to {self.max_seq_len} tokens with block_size={self.block_size}."
            )

    def for_window(self, window: int) -> AttentionMetadata:
        """This step as a layer with a sliding window of `window` positions sees it: each
        request's block row starts at the block holding the first key its first query row can
        see, and its seq_len counts from that block's start. Query rows keep their relative
        places (row j of request i is still the j-th of the last query_len positions), so a
        backend that masks keys more than `window - 1` positions behind each query, in these
        shifted coordinates, computes the window exactly, and never reads a block the window
        has left (which the KV cache manager may have given back). slot_mapping is unchanged:
        writes go where they always go."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        block_size = self.block_size
        skip = [
            max(seq_len - q_len - window + 1, 0) // block_size
            for q_len, seq_len in zip(self.query_lens, self.seq_lens)
        ]
        if not any(skip):
            return self
        cols = self.block_table.shape[1]
        device = self.block_table.device
        # Row i's columns skip[i] .. skip[i] + width - 1 (clamped: past a row's blocks the
        # entries are never read).
        width = cols - min(skip)
        columns = torch.arange(width, device=device).unsqueeze(0) + torch.tensor(
            skip, device=device
        ).unsqueeze(1)
        table = self.block_table[: self.num_reqs].gather(1, columns.clamp_(max=cols - 1))
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=[s - first * block_size for s, first in zip(self.seq_lens, skip)],
            slot_mapping=self.slot_mapping,
            block_table=table,
            block_size=block_size,
        )

    def decode_idx(self) -> list[int]:
        """Indices of the requests with one query token."""
        return [i for i, q_len in enumerate(self.query_lens) if q_len == 1]

    def chunk_idx(self) -> list[int]:
        """Indices of the requests with several query tokens (prompts or chunks of them)."""
        return [i for i, q_len in enumerate(self.query_lens) if q_len > 1]

    def block_rows(self, req_idx: list[int]) -> Tensor:
        """These requests' block_table rows, in order, cut after the longest one's last block:
        (len(req_idx), max_num_blocks)."""
        max_num_blocks = -(-max(self.seq_lens[i] for i in req_idx) // self.block_size)
        if len(req_idx) == self.num_reqs:  # every request, in batch order
            rows = self.block_table[: self.num_reqs]
        else:
            rows = self.block_table[torch.tensor(req_idx, device=self.block_table.device)]
        return rows[:, :max_num_blocks]

    def slots(self, req: int, num_positions: int) -> Tensor:
        """(num_positions,) int64 cache slots of positions 0.. of request `req`."""
        positions = torch.arange(num_positions, device=self.block_table.device)
        block_ids = self.block_table[req, positions // self.block_size].long()
        return block_ids * self.block_size + positions % self.block_size
