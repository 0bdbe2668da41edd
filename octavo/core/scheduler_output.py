"""Plain data that crosses the scheduler -> runner -> scheduler boundary once per step.

The runner keeps a persistent batch; these objects tell it what changed. A request is sent in
full once (NewRequestData: on admission and again on resume after a preemption) and as deltas
afterwards (CachedRequestData). No torch here: the runner turns this into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from octavo.core.pooling_params import PoolingParams
from octavo.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a first admission). The runner
    # recomputes their KV like prompt tokens, but penalties count them as output.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # The resolved stop token ids (EOS unless ignore_eos, and the user's): min_tokens holds
    # them back while sampling.
    stop_token_ids: frozenset[int]
    # All of the request's blocks, in order (prefix-cache hits first).
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix hits); the step computes from here.
    num_computed_tokens: int
    # KV cache groups 1..'s block lists, place for place beside block_ids (group 0's); empty
    # for a one-group cache.
    group_block_ids: tuple[list[int], ...] = ()
    # Set for a pooling request: the runner pools its prompt's hidden states (the last chunk
    # returns the vector) and samples nothing for it.
    pooling_params: PoolingParams | None = None


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    request_id: str
    # Blocks appended to the request's block list since the last step.
    new_block_ids: list[int]
    # Tokens whose KV is in the cache before this step runs.
    num_computed_tokens: int
    # Blocks appended to KV cache groups 1..'s lists (as many as new_block_ids each).
    new_group_block_ids: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # request_id -> tokens run this step (a decode is 1, or 1 + its proposed tokens; a
    # prefill chunk is its length).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop from its batch: preempted this step (they come back later
    # as NewRequestData) and finished or aborted since the last step.
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured-output requests that sample a token this step (their last known token is
    # computed by it), in scheduling order; a mid-prompt chunk is not among them.
    structured_output_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request_id -> the proposed tokens it verifies this step, which
    # follow its last known token in its num_scheduled_tokens (1 + their number). The runner
    # returns up to 1 + their number tokens for it (those accepted, then one more).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Draft-model speculation: request_id -> KV slots allocated beyond this step's tokens,
    # for requests whose step samples and whose next step may verify proposals; the runner's
    # draft proposes for them after the step, writing its KV at most that far ahead.
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    # Filled by the engine between schedule and execute: int32 rows of ceil(vocab / 32)
    # words, the allowed-token bits (bit t % 32 of word t // 32 set = token t allowed) of each
    # structured request in turn, one row per position it samples: after its known tokens,
    # then after each of its proposed tokens (grammar_mask_rows). None when no structured
    # request samples this step.
    grammar_bitmask: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def grammar_mask_rows(self) -> dict[str, int]:
        """Each structured request's first row in grammar_bitmask; its row after j proposed
        tokens is that + j."""
        first_rows: dict[str, int] = {}
        row = 0
        for request_id in self.structured_output_req_ids:
            first_rows[request_id] = row
            row += 1 + len(self.scheduled_spec_decode_tokens.get(request_id, ()))
        return first_rows
