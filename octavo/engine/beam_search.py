"""Beam search over the engine, as vLLM runs it: each step, every live beam is one request
for one token with the top 2 * beam_width logprobs; their candidates are ranked here.

Owns one prompt's search state (`BeamSearch`: live beams, finished ones, the step count), the
score (`get_beam_search_score`, vLLM's) and vLLM's output shapes (`BeamSearchSequence`,
`BeamSearchOutput`). The engine sees only ordinary one-token requests: a beam's whole token
list is its prompt, so the prefix cache serves the part beams share (full blocks), and a
dropped beam holds no KV block (its request finished with its step).

Must not: submit requests or step the engine (the offline LLM and the server drive a search,
each in its own way), tokenize, or import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from octavo.core.request import FinishReason
from octavo.core.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.outputs import Logprob, SampleLogprobs


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's name and fields): `tokens` holds the prompt's tokens, then the beam's
    (its EOS last, if it ended on one); `logprobs` one dict per generated position (the step's
    candidates); `text` is set only on the beams returned."""

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.orig_prompt["prompt_token_ids"])


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int] | None,
    length_penalty: float = 1.0,
) -> float:
    """vLLM's score: cumulative_logprob / length ** length_penalty, where length counts every
    token of `tokens` (prompt included) but a final EOS."""
    eos_ids = _as_set(eos_token_id)
    length = len(tokens)
    if tokens and tokens[-1] in eos_ids:
        length -= 1
    return cumulative_logprob / (max(length, 1) ** length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | Collection[int] | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def step_sampling_params(
    params: BeamSearchParams, num_logprobs: int = 0, seed: int | None = None
) -> SamplingParams:
    """What each beam's one-token request asks for: one draw at the search's temperature and
    the top max(2 * beam_width, num_logprobs) logprobs (more only when the caller reports
    more per position; the search itself looks at the top 2 * beam_width)."""
    return SamplingParams(
        max_tokens=1,
        temperature=params.temperature,
        logprobs=max(2 * params.beam_width, num_logprobs),
        seed=seed,
    )


def check_beam_width(max_logprobs: int, beam_width: int, param: str) -> None:
    """A search reads the top 2 * beam_width logprobs of each step: more than max_logprobs
    (--max-logprobs) allows is a ValueError naming `param` (the width's name for the caller)."""
    if 2 * beam_width > max_logprobs:
        raise ValueError(
            f"{param}={beam_width}: a beam search reads the top 2 * {param} = "
            f"{2 * beam_width} logprobs of each step, more than max_logprobs={max_logprobs} "
            "(--max-logprobs) allows."
        )


class BeamSearch:
    """One prompt's beam search. `beams` are the live ones, in the order their next step's
    results are expected; `advance` takes those results, `best` ranks the outcome."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        prompt: str | None = None,
    ) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.orig_prompt = {"prompt": prompt, "prompt_token_ids": list(prompt_token_ids)}
        self.beams = [BeamSearchSequence(self.orig_prompt, list(prompt_token_ids), [])]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0
        # Under ignore_eos an EOS token is a token like any other, a final one counted in the
        # length too (vLLM leaves it out of the length even then, which ranks a beam that
        # happens to end on it as if it were one token shorter).
        self._sort_key = create_sort_beams_key_function(
            () if params.ignore_eos else self.eos_token_ids, params.length_penalty
        )

    def is_done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def advance(self, steps: Sequence[tuple[int, dict[int, Logprob]]]) -> None:
        """One step: per live beam (in `beams` order), its drawn token and its logprobs.

        Candidates are the top 2 * beam_width tokens of each beam by rank, and the drawn one.
        A candidate ending in EOS (unless ignore_eos) is set aside as finished; of the others
        the beam_width best by cumulative logprob become the live beams (ties keep beam, then
        rank, order)."""
        if len(steps) != len(self.beams):
            raise ValueError(f"{len(steps)} step results for {len(self.beams)} live beams.")
        num_candidates = 2 * self.params.beam_width
        candidates: list[BeamSearchSequence] = []
        for beam, (drawn, position) in zip(self.beams, steps):
            for token_id, logprob in position.items():
                if token_id != drawn and (logprob.rank is None or logprob.rank > num_candidates):
                    continue
                child = BeamSearchSequence(
                    self.orig_prompt,
                    beam.tokens + [token_id],
                    beam.logprobs + [position],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason = FinishReason.STOP
                    child.stop_reason = token_id
                    self.completed.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=lambda beam: -beam.cum_logprob)
        self.beams = candidates[: self.params.beam_width]
        self.num_steps += 1

    def abort(self) -> None:
        """A step's request was aborted: the search ends, its live beams finished "abort"."""
        for beam in self.beams:
            beam.finish_reason = FinishReason.ABORT
        self.completed.extend(self.beams)
        self.beams = []

    def best(self) -> list[BeamSearchSequence]:
        """The best beam_width of the finished and live beams, best first; a live beam ends
        "length"."""
        for beam in self.beams:
            beam.finish_reason = FinishReason.LENGTH
        ranked = sorted(self.completed + self.beams, key=self._sort_key, reverse=True)
        return ranked[: self.params.beam_width]


def _as_set(eos_token_id: int | Collection[int] | None) -> Collection[int]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return eos_token_id


__all__ = [
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "check_beam_width",
    "create_sort_beams_key_function",
    "get_beam_search_score",
    "step_sampling_params",
]
