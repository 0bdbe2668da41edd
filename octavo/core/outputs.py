"""What the runner returns to the scheduler, and what the scheduler hands to the output
processor, once per step. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.core.request import FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position, from the raw model distribution."""

    # The sampled token first, then the top-k tokens in descending order.
    token_ids: list[int]
    logprobs: list[float]
    # 1-based rank of the sampled token in the full distribution.
    sampled_rank: int


# The logprobs of prompt tokens 1.. in order: each entry's "sampled" token is the prompt token
# itself, scored by the logits of the position before it (the first prompt token has none).
PromptTokenLogprobs = list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    # Every request scheduled this step, in the runner's batch order.
    req_ids: list[str]
    # One list per request: the sampled token (empty for a prefill chunk that is not last).
    sampled_token_ids: list[list[int]]
    # Parallel to sampled_token_ids; None where the request did not ask for logprobs.
    logprobs: list[list[TokenLogprobs] | None]
    # Requests whose own preparation or sampling raised this step (request id -> why): they
    # got no token, and the scheduler ends them with FINISHED_ERROR. The rest ran normally.
    failed: dict[str, str] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and sampled their first token this step: all of
    # their prompt's logprobs, gathered across its chunks (once per request).
    prompt_logprobs: dict[str, PromptTokenLogprobs] = field(default_factory=dict)
    # Pooling requests whose last prompt token was computed this step: their pooled vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # A draft model's proposals (speculative decoding, method draft_model) for the requests
    # in SchedulerOutput.num_lookahead_tokens: the tokens it proposes after each one's last.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step: tokens appended and, maybe, the end."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    # Set once the request has finished, else None.
    finish_reason: FinishReason | None = None
    # The stop token id that ended it (None for EOS or a length cap).
    stop_reason: int | str | None = None
    # Why the engine could not run it (finish_reason ERROR only).
    error: str | None = None
    num_cached_tokens: int = 0
    # Set once, beside the first token, for a request that asked for prompt logprobs.
    prompt_logprobs: PromptTokenLogprobs | None = None
    # A pooling request's vector, set with its finish (it has no tokens).
    pooled: list[float] | None = None
