"""Metric snapshots as plain dataclasses: what the scheduler and the engine report, what
loggers read.

A leaf: imports nothing from octavo (FinishReason only as a type), knows nothing of
Prometheus or log formats. Cumulative
counters stay cumulative in SchedulerStats; IterationStats carries one step's deltas.
Times are seconds from `time.monotonic()`, measured by the engine (never by `core`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from octavo.core.request import FinishReason

# Why the serving frontend rejected a request at submission: the queue bound it met (vLLM's
# label values of vllm:admission_rejections, and octavo's max_queue_wait: its predicted time
# to first token was over --max-queue-wait; engine/queue_limits.py checks the bounds).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens", "max_queue_wait")


class KVBlockEvent(enum.IntEnum):
    """What the block pool reports of a KV block it samples for residency metrics (vLLM's
    --kv-cache-metrics): taken for new data, found by a prefix-cache hit, taken again for
    other data (the end of its sampled life, which vLLM calls its eviction)."""

    ALLOCATED = 0
    ACCESSED = 1
    EVICTED = 2


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Speculative decoding's counters, cumulative since start-up (vLLM's spec_decode
    metrics): verifications with proposed tokens (drafts), the tokens proposed, those
    accepted, and the accepted ones by their place in the proposal (0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: the accepted ones and the one sampled
        after them (vLLM's mean acceptance length); 1 before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @classmethod
    def combined(cls, stats: list[SpecDecodingStats]) -> SpecDecodingStats:
        num_pos = max((len(s.num_accepted_tokens_per_pos) for s in stats), default=0)
        return cls(
            num_drafts=sum(s.num_drafts for s in stats),
            num_draft_tokens=sum(s.num_draft_tokens for s in stats),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
            num_accepted_tokens_per_pos=tuple(
                sum(
                    s.num_accepted_tokens_per_pos[i]
                    for s in stats
                    if i < len(s.num_accepted_tokens_per_pos)
                )
                for i in range(num_pos)
            ),
        )


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """One snapshot of the scheduler and its KV cache, taken after a step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks held by requests, 0-1 (vllm:kv_cache_usage_perc).
    kv_cache_usage: float = 0.0
    # Cumulative since start-up.
    num_preemptions: int = 0
    # Cumulative, in tokens: tokens looked up in the prefix cache at admission, and the
    # tokens found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    # Of the waiting ones, those held back by something other than room: a structured-output
    # grammar still compiling (vLLM's `deferred` reason; the others wait for `capacity`).
    num_deferred_reqs: int = 0
    # None while the engine is awake; else the level of the sleep it is in (vLLM's sleep
    # mode: 0 pauses the steps, 1 also releases the KV cache, 2 the weights too). It stays
    # asleep, at that level, until wake_up has restored everything.
    sleep_level: int | None = None
    # Speculative decoding's counters; None where it is off.
    spec_decoding: SpecDecodingStats | None = None

    @classmethod
    def combined(cls, stats: list[SchedulerStats]) -> SchedulerStats:
        """Several engines' snapshots as one (data-parallel replicas): counts add up, the KV
        usage is that of all their blocks together."""
        num_blocks = sum(s.num_blocks for s in stats)
        return cls(
            num_running_reqs=sum(s.num_running_reqs for s in stats),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
            kv_cache_usage=(
                sum(s.kv_cache_usage * s.num_blocks for s in stats) / num_blocks
                if num_blocks
                else 0.0
            ),
            num_preemptions=sum(s.num_preemptions for s in stats),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            num_free_blocks=sum(s.num_free_blocks for s in stats),
            num_blocks=num_blocks,
            num_deferred_reqs=sum(s.num_deferred_reqs for s in stats),
            sleep_level=max(
                (s.sleep_level for s in stats if s.sleep_level is not None), default=None
            ),
            spec_decoding=(
                SpecDecodingStats.combined(spec)
                if (spec := [s.spec_decoding for s in stats if s.spec_decoding is not None])
                else None
            ),
        )


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One request's life, measured by the engine when it finished (one output stream: each
    child of an n > 1 request counts on its own, as in vLLM)."""

    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generation_tokens: int
    # The request's effective max_tokens (the user's value or what max_model_len left).
    max_tokens: int
    # Arrival -> finish.
    e2e_latency_s: float
    # Arrival -> first scheduled (-> finish if it never was).
    queue_time_s: float
    # Arrival -> first token; None if it produced none.
    ttft_s: float | None
    # First scheduled -> first token, and first token -> last token; 0 without tokens.
    prefill_time_s: float
    decode_time_s: float
    # The largest gap between two consecutive tokens after the first; 0 with < 2 tokens.
    max_token_gap_s: float
    num_evictions: int
    # Eviction -> the request's next token, one per eviction that was followed by a token.
    eviction_freezes_s: tuple[float, ...] = ()
    # Prompt tokens found in the prefix cache when it was first admitted.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class IterationStats:
    """What one engine step did, plus requests aborted since the step before: the deltas
    loggers add to counters and histograms."""

    # Tokens the step ran (prompt chunks and decodes), and of them the prompt-chunk tokens
    # (recomputations after an eviction included): every scheduled request but those running
    # one token. Together with the step's time (schedule to outputs; 0 for a snapshot that is
    # no step) they give the engine's measured step rates (engine/step_rates.py).
    num_scheduled_tokens: int = 0
    num_scheduled_prompt_tokens: int = 0
    step_time_s: float = 0.0
    # Prompt tokens of requests that got their first token in this step (vLLM counts a
    # prompt once, when its prefill is done), and how many of them came from the prefix cache
    # rather than being computed.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # Requests evicted for the first time in this step.
    num_newly_evicted_reqs: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    # One per request that got a token after its first: the time since its previous one.
    inter_token_latencies_s: list[float] = field(default_factory=list)
    # Freezes that ended in this step (eviction -> next token).
    eviction_freezes_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # One entry per caller's request that finished (all n of its streams): its n and the most
    # tokens one of its streams generated. The frontend adds these (it owns the fan-out).
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    # Sampled KV blocks whose life ended (taken again for other data): allocation -> end,
    # last access (allocation or prefix hit) -> end, and the gaps between its last few prefix
    # hits (vLLM's vllm:kv_block_* histograms).
    kv_block_lifetimes_s: list[float] = field(default_factory=list)
    kv_block_idle_before_evict_s: list[float] = field(default_factory=list)
    kv_block_reuse_gaps_s: list[float] = field(default_factory=list)
    # Sleep-mode operations done since the last snapshot: ("sleep" or "wake", seconds taken).
    sleep_mode_operations_s: list[tuple[str, float]] = field(default_factory=list)


class StatLogger(Protocol):
    """Anything the engine hands each step's stats to, on the engine thread: cheap, and
    never raising into the step. `engine_index` names the engine (the data-parallel replica)
    whose step it was; 0 where there is one."""

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats,
        engine_index: int = 0,
    ) -> None: ...
