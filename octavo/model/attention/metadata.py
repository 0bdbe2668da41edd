"""AttentionMetadata: where each request's tokens sit in the flat batch and in the paged cache.

The runner fills in five fields per forward; everything the backends derive from them (query
lengths, the batched-decode gather indices, per-chunk causal masks) is computed once here, in
`__post_init__`, and shared by every layer of that forward. Plain Python ints stay on the host so
that no backend needs a device-to-host sync to learn a shape. This module knows nothing of
requests beyond their index in the batch.

A request i with query_len q_i and seq_len s_i (tokens in the cache after this step's writes):

    cache positions    0 ............ s_i - q_i - 1 | s_i - q_i .......... s_i - 1
                       computed before this step    | this step's tokens (rows of the batch)
    query row j (0 <= j < q_i) sits at position s_i - q_i + j and sees keys 0 .. s_i - q_i + j.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from octavo.model import kernels

AttentionBackendName = Literal["sdpa", "reference"]


@dataclass(slots=True)
class DecodeBatch:
    """Requests with one query token each, attended together: by the paged decode kernel,
    which reads blocks in place, or else in one padded SDPA call over gathered blocks."""

    req_idx: list[int]
    # (num_decodes,) int64 rows of the flat batch; None when they are rows 0..n-1 in order.
    token_idx: Tensor | None
    max_num_blocks: int
    # Kernel path: (num_decodes, max_num_blocks) int32 block ids and (num_decodes,) int32
    # sequence lengths; None on the SDPA path.
    block_table: Tensor | None = None
    seq_lens: Tensor | None = None
    # SDPA path: (num_decodes * max_num_blocks,) int64, each request's blocks in order, padded
    # with block 0. Whole blocks are gathered (one index_select of block_size * heads * head_dim
    # rows each), several times faster on a CPU than gathering slot by slot.
    block_ids: Tensor | None = None
    # SDPA path: (num_decodes, 1, 1, max_num_blocks * block_size) bool, True where a key exists
    # (broadcast over heads); hides the tail of the last block and the padding blocks.
    key_mask: Tensor | None = None


@dataclass(slots=True)
class PrefillBatch:
    """Every request with several query tokens, attended together by the paged prefill kernel,
    which reads their keys in place: (num_chunks, max_num_blocks) int32 block ids and
    (num_chunks,) int32 first rows in the flat batch, query lengths and sequence lengths."""

    block_table: Tensor
    query_start: Tensor
    query_lens: Tensor
    seq_lens: Tensor


@dataclass(slots=True)
class PrefillChunk:
    """One request with several query tokens (a whole prompt or a chunk of one)."""

    req_idx: int
    start: int  # first row in the flat batch
    end: int  # one past the last row
    # (seq_len,) int64 cache slots of all its keys; None when this chunk is the whole sequence,
    # so its keys are exactly this step's k/v and need no gather.
    kv_slots: Tensor | None
    # (query_len, seq_len) bool causal mask shifted by the cached prefix; None means plain causal.
    mask: Tensor | None


@dataclass
class AttentionMetadata:
    # Request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1] of the flat batch.
    query_start_loc: list[int]  # (num_reqs + 1,)
    # Tokens of request i in the cache after this step's writes (computed before + scheduled now).
    seq_lens: list[int]  # (num_reqs,)
    slot_mapping: Tensor  # (num_tokens,) int64: slot = block_id * block_size + offset
    block_table: Tensor  # (num_reqs, max_blocks_per_req) int32, request i's block ids, 0-padded
    block_size: int
    backend: AttentionBackendName = "sdpa"
    # sdpa backend: decodes and prompt chunks through the paged kernels (True), through gathered
    # blocks and SDPA (False), or the kernels where they are built and the tensors are on a CPU
    # (None).
    paged_kernels: bool | None = None

    # Derived, never passed in.
    num_reqs: int = field(init=False)
    num_tokens: int = field(init=False)
    query_lens: list[int] = field(init=False)
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)
    is_all_decode: bool = field(init=False)
    decode: DecodeBatch | None = field(init=False, repr=False)
    # Requests with several query tokens: all in `prefill` on the kernel path, else one
    # PrefillChunk each in `chunks`.
    prefill: PrefillBatch | None = field(init=False, repr=False)
    chunks: list[PrefillChunk] = field(init=False, repr=False)

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
        self.decode = None
        self.prefill = None
        self.chunks = []
        if self.backend == "sdpa":
            paged = self.paged_kernels
            if paged is None:
                paged = self.block_table.device.type == "cpu" and kernels.available()
            self._plan_decodes(paged)
            self._plan_chunks(paged)

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
        if self.backend not in ("sdpa", "reference"):
            raise ValueError(f"backend must be 'sdpa' or 'reference', got {self.backend!r}.")

    def _slots(self, block_rows: Tensor, num_positions: int) -> Tensor:
        """(n, num_positions) int64 cache slots of positions 0.. of each block_table row given."""
        positions = torch.arange(num_positions, device=block_rows.device)
        block_ids = block_rows[:, positions // self.block_size].long()
        return block_ids * self.block_size + positions % self.block_size

    def _block_rows(self, req_idx: list[int]) -> Tensor:
        """These requests' block_table rows, in order, cut after the longest one's last block:
        (len(req_idx), max_num_blocks)."""
        max_num_blocks = -(-max(self.seq_lens[i] for i in req_idx) // self.block_size)
        if len(req_idx) == self.num_reqs:  # every request, in batch order
            rows = self.block_table[: self.num_reqs]
        else:
            rows = self.block_table[torch.tensor(req_idx, device=self.block_table.device)]
        return rows[:, :max_num_blocks]

    def _plan_decodes(self, paged: bool) -> None:
        req_idx = [i for i, q_len in enumerate(self.query_lens) if q_len == 1]
        if not req_idx:
            return
        device = self.block_table.device
        token_idx = None
        if not self.is_all_decode:
            token_idx = torch.tensor([self.query_start_loc[i] for i in req_idx], device=device)
        rows = self._block_rows(req_idx)
        max_num_blocks = rows.shape[1]
        if paged:
            self.decode = DecodeBatch(
                req_idx=req_idx,
                token_idx=token_idx,
                max_num_blocks=max_num_blocks,
                block_table=rows.to(torch.int32).contiguous(),
                seq_lens=_int32([self.seq_lens[i] for i in req_idx]),
            )
            return
        seq_lens = torch.tensor([self.seq_lens[i] for i in req_idx], device=device)
        max_len = max_num_blocks * self.block_size
        key_mask = torch.arange(max_len, device=device).unsqueeze(0) < seq_lens.unsqueeze(1)
        self.decode = DecodeBatch(
            req_idx=req_idx,
            token_idx=token_idx,
            max_num_blocks=max_num_blocks,
            block_ids=rows.reshape(-1).long(),
            key_mask=key_mask[:, None, None, :],  # (num_decodes, 1, 1, max_len)
        )

    def _plan_chunks(self, paged: bool) -> None:
        device = self.block_table.device
        if paged:
            req_idx = [i for i, q_len in enumerate(self.query_lens) if q_len > 1]
            if req_idx:
                self.prefill = PrefillBatch(
                    block_table=self._block_rows(req_idx).to(torch.int32).contiguous(),
                    query_start=_int32([self.query_start_loc[i] for i in req_idx]),
                    query_lens=_int32([self.query_lens[i] for i in req_idx]),
                    seq_lens=_int32([self.seq_lens[i] for i in req_idx]),
                )
            return
        for i, q_len in enumerate(self.query_lens):
            if q_len == 1:
                continue
            start, seq_len = self.query_start_loc[i], self.seq_lens[i]
            kv_slots = mask = None
            if seq_len > q_len:
                kv_slots = self._slots(self.block_table[i : i + 1], seq_len)[0]  # (seq_len,)
                key_pos = torch.arange(seq_len, device=device)
                query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (q_len, seq_len)
            self.chunks.append(PrefillChunk(i, start, start + q_len, kv_slots, mask))


def _int32(values: list[int]) -> Tensor:
    """A host int32 tensor, as the CPU kernels read their lengths and offsets."""
    return torch.tensor(values, dtype=torch.int32)
