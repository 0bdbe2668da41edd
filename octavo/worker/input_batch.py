"""InputBatch: the runner's persistent per-request state, updated by deltas each step.

Rows [0, num_reqs) are the requests the runner knows about. A request keeps its row until it
finishes or is preempted; then the last row moves into the hole so the live rows stay dense and
per-row arrays can be sliced `[:num_reqs]`. Token ids and block tables live in preallocated
numpy arrays on the host (they feed index arithmetic, not the model directly); only the flat
per-step inputs are copied to the device. The per-row sampling parameters are one array per
entry of octavo.sample.metadata.ROW_PARAMS, filled, moved and read by that table alone.

It never sees a Request object: everything arrives through SchedulerOutput data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler_output import NewRequestData
from octavo.sample.metadata import ROW_PARAMS


@dataclass(slots=True)
class RowState:
    request_id: str
    sampling_params: SamplingParams
    # The token ids min_tokens holds back: EOS (unless ignore_eos) and the user's stop ids.
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # (max_num_reqs, max_model_len): prompt tokens, then output tokens.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # (max_num_reqs, max_num_blocks_per_req): block ids in order, padded with 0.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # KV cache groups 1..'s tables, place for place beside block_table (group 0's).
        self.group_tables = np.zeros(
            (num_kv_groups - 1, max_num_reqs, max_num_blocks_per_req), dtype=np.int32
        )
        # Per-row sampling knobs, as arrays so a step slices them instead of looping.
        self.sampling = {
            param.name: np.full(max_num_reqs, param.neutral, dtype=param.dtype)
            for param in ROW_PARAMS
        }
        self.rows: list[RowState] = []
        self.row_of: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def add(self, data: NewRequestData, generator: torch.Generator | None) -> None:
        if data.request_id in self.row_of:
            raise RuntimeError(f"request {data.request_id!r} is already in the batch")
        row = len(self.rows)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"batch is full ({self.max_num_reqs} requests)")
        tokens = data.prompt_token_ids + data.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, data.block_ids, data.group_block_ids)
        params = data.sampling_params
        for name, values in self.sampling.items():
            values[row] = getattr(params, name)
        self.rows.append(RowState(data.request_id, params, data.stop_token_ids, generator))
        self.row_of[data.request_id] = row

    def append_block_ids(
        self, row: int, block_ids: list[int], group_block_ids: tuple[list[int], ...] = ()
    ) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        for table, ids in zip(self.group_tables, group_block_ids, strict=True):
            table[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def write_draft_tokens(self, row: int, token_ids: list[int]) -> None:
        """Place proposed tokens after the row's known ones, where the step reads its input
        tokens; they are not among its tokens (num_tokens is unchanged) until appended."""
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    def remove(self, request_id: str) -> None:
        """Drop a request; the last row moves into its place (dense rows)."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = len(self.rows) - 1
        if row != last:
            self._move_row(last, row)
        self.rows.pop()

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        self.group_tables[:, dst, :nb] = self.group_tables[:, src, :nb]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            *self.sampling.values(),
        ):
            array[dst] = array[src]
        self.rows[dst] = self.rows[src]
        self.row_of[self.rows[dst].request_id] = dst

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()
