"""What callers of the offline API and the server receive: vLLM's RequestOutput shape, and for
pooling requests vLLM's PoolingRequestOutput (EmbeddingRequestOutput from LLM.embed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from octavo.core.outputs import TokenLogprobs
from octavo.core.request import FinishReason


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then a dict as above
# whose "sampled" token is that prompt token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended it; None for EOS or length.
    stop_reason: int | str | None = None
    # Why the engine could not run it (finish_reason ERROR only; octavo's).
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the request asked for prompt_logprobs (vLLM's field); under DELTA output, only
    # in the first RequestOutput.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class PoolingOutput:
    """vLLM's: a pooling request's pooled vector (a list of floats here, not a tensor)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """vLLM's: what a pooling request ends with. `finish_reason` and `error` are octavo's: an
    aborted or failed request has no vector (empty data) and says why."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's: one embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: what LLM.embed returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(list(output.outputs.data)),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )


def to_sample_logprobs(
    token_logprobs: list[TokenLogprobs], decode: Callable[[int], str] | None = None
) -> SampleLogprobs:
    """Turn the runner's per-position logprobs into vLLM's dict-per-position form."""
    result: SampleLogprobs = []
    for position in token_logprobs:
        entry: dict[int, Logprob] = {}
        for rank, (token_id, logprob) in enumerate(
            zip(position.token_ids[1:], position.logprobs[1:]), start=1
        ):
            entry[token_id] = Logprob(logprob, rank, decode(token_id) if decode else None)
        sampled = position.token_ids[0]
        entry[sampled] = Logprob(
            position.logprobs[0], position.sampled_rank, decode(sampled) if decode else None
        )
        result.append(entry)
    return result


def to_prompt_logprobs(
    token_logprobs: list[TokenLogprobs], decode: Callable[[int], str] | None = None
) -> PromptLogprobs:
    """The runner's logprobs of prompt tokens 1.. as vLLM's prompt_logprobs: None for the
    first token, then per token a dict with the prompt token's own entry first, then the top-k
    (a prompt token among them keeps its own rank)."""
    result: PromptLogprobs = [None]
    for position in token_logprobs:
        token_id = position.token_ids[0]
        entry = {
            token_id: Logprob(
                position.logprobs[0], position.sampled_rank, decode(token_id) if decode else None
            )
        }
        for rank, (top_id, logprob) in enumerate(
            zip(position.token_ids[1:], position.logprobs[1:]), start=1
        ):
            if top_id != token_id:
                entry[top_id] = Logprob(logprob, rank, decode(top_id) if decode else None)
        result.append(entry)
    return result
