"""Request: the scheduler's record of one prompt and its one output stream.

Only the scheduler mutates a Request. `n > 1` is fanned out by the engine into child requests
before they get here, so every Request has exactly one output.

A structured-output request carries a `RequestGrammar`: the small protocol through which the
scheduler drives a grammar without knowing the library behind it (core imports none).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Protocol

from octavo.core.pooling_params import PoolingParams
from octavo.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every state after PREEMPTED is a finished one.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The engine could not run this request (preparing or sampling it raised); the others in
    # its batch ran on.
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class ResolvedParams:
    """What the engine resolves of a request's SamplingParams against the model, once, before
    the scheduler sees the request (InputProcessor.resolve_params)."""

    # The user's max_tokens, or what max_model_len leaves after the prompt.
    max_tokens: int
    # The token ids that end the request: the user's stop_token_ids, and the model's EOS ids
    # unless ignore_eos.
    stop_token_ids: frozenset[int]


class RequestGrammar(Protocol):
    """One request's output constraint, as the scheduler uses it. Each request (each n > 1
    child too) has its own: the state advances with that request's tokens only."""

    def is_ready(self) -> bool:
        """Compiled: the request may be admitted. Until then the scheduler passes it over
        and admits those behind it."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it; it is then
        terminated."""
        ...

    def is_terminated(self) -> bool:
        """Complete (or failed): nothing but EOS may follow, and the next token ends the
        request."""
        ...

    def error(self) -> str | None:
        """Why the grammar can no longer be followed (the library's error state), or None.
        A failed grammar ends its request with an error, never as if its output were
        complete."""
        ...

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from its state (a
        speculative proposal is cut there); the state does not change."""
        ...


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        resolved: ResolvedParams,
        arrival_time: float | None = None,
        grammar: RequestGrammar | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """`resolved` is the engine's: the effective max_tokens (the caller has checked that
        prompt + max_tokens fits) and the stop token ids. `sampling_params` is the request's
        own copy, which nothing changes afterwards. `grammar` is set for a structured-output
        request; it sees every output token exactly once. `priority` is vLLM's: lower runs
        earlier under the priority scheduling policy; fcfs ignores it. `pooling_params` makes it a
        pooling request: its prompt is run and pooled, nothing is sampled, and it ends in the
        step that computes its last prompt token."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = resolved.max_tokens
        self.stop_token_ids = resolved.stop_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.grammar = grammar
        self.priority = priority
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # Prompt followed by output; kept as one list so the scheduler never concatenates.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose KV is in the cache (prefix hits included).
        self.num_computed_tokens = 0
        # Prefix-cache hits at first admission; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks, extended as tokens arrive.
        self.block_hashes: list[int] = []
        # The token id or stop string that stopped the request, if any (not EOS).
        self.stop_reason: int | str | None = None
        # Why the engine could not run it (FINISHED_ERROR only).
        self.error: str | None = None
        # A pooling request's vector, once the runner has pooled its prompt.
        self.pooled: list[float] | None = None
        # Speculative decoding: tokens proposed to follow its next one, verified by the next
        # step that schedules it (core/spec_decode.py); never part of all_token_ids.
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether the request must compute every prompt position (its pooling reads them)."""
        return bool(self.pooling_params and self.pooling_params.skip_reading_prefix_cache)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
