"""MockRunner: a stand-in for the model runner where the engine's logic is under test, not the
model's arithmetic (engine and scheduler tests, `octavo bench policies`).

It speaks the runner's protocol exactly: it learns of requests only from SchedulerOutput
deltas (new requests in full, then computed-token counts), drops finished and preempted ones,
and returns a ModelRunnerOutput with a token for every scheduled request whose known tokens
are all computed after the step (a prompt chunk that is not the last samples nothing). Its
"model" is a rule, cheap and deterministic:

- greedy requests (temperature 0) continue a fixed `script` of token ids by position: the token
  after n known tokens is script[n % len(script)], whatever else is in the batch;
- random ones draw from the script with the request's own random.Random(seed) (seeded
  requests; the runner's own otherwise), kept across preemptions as the real runner keeps its
  generators;
- a request named in `answer_lens` writes EOS as its answer_len-th output token (or as soon
  after it as min_tokens allows), and goes on writing EOS if ignore_eos keeps it running;
- while a request is below min_tokens its stop token ids are skipped, and a structured-output
  request takes the first token, in the script's order, its grammar's bitmask allows;
- logprobs, when asked, hold the sampled token at rank 1 and then the script's next tokens.

Each step also counts its work (`last_work`: prompt tokens, decodes, recomputed tokens), from
which a benchmark prices a step. Plain Python: no torch, no model.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from octavo.core.outputs import ModelRunnerOutput, TokenLogprobs
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computed: prompt (or recomputed) tokens, decodes, and the prompt tokens
    below a request's furthest computed KV (work redone after an eviction)."""

    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_redone_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    token_ids: list[int]
    num_output_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    # The furthest its KV ever got: tokens below it computed again are redone work.
    max_computed_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class MockRunner:
    def __init__(
        self,
        vocab_size: int,
        eos_token_id: int,
        script: Sequence[int] | None = None,
        answer_lens: Mapping[str, int] | None = None,
        seed: int = 0,
    ) -> None:
        """`script`: the token ids the mock model writes (default: every id above EOS);
        `answer_lens`: request id -> output length at which it writes EOS."""
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.script = list(range(eos_token_id + 1, vocab_size) if script is None else script)
        if not self.script or any(not 0 <= t < vocab_size for t in self.script):
            raise ValueError(f"script must be non-empty ids below vocab_size={vocab_size}.")
        self.answer_lens = dict(answer_lens or {})
        self._rng = random.Random(seed)
        self._requests: dict[str, _RequestState] = {}
        # Seeded requests keep their generator across preemptions, as the real runner does.
        self._generators: dict[str, random.Random] = {}
        self.last_work = StepWork()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update(out)
        masks = {}
        if out.grammar_bitmask is not None:
            # Each request's mask before this step's tokens.
            bitmask = out.grammar_bitmask
            masks = {r: bitmask[row] for r, row in out.grammar_mask_rows().items()}
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        num_prefill = num_decodes = num_redone = 0
        for request_id in req_ids:
            state = self._requests[request_id]
            num_new = out.num_scheduled_tokens[request_id]
            begin, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            # A decode runs the newest token once; anything else is a prompt chunk, and the
            # part of it below the furthest KV ever computed is redone after an eviction.
            is_decode = (
                num_new == 1
                and end == len(state.token_ids)
                and state.num_output_tokens > 0
                and begin >= state.max_computed_tokens
            )
            if is_decode:
                num_decodes += 1
            else:
                num_prefill += num_new
                num_redone += max(min(end, state.max_computed_tokens) - begin, 0)
            state.max_computed_tokens = max(state.max_computed_tokens, end)
            state.num_computed_tokens = end
            if end < len(state.token_ids):
                sampled.append([])  # a prompt chunk that is not the last
                logprobs.append(None)
                continue
            token_id = self._sample(request_id, state, masks.get(request_id))
            state.token_ids.append(token_id)
            state.num_output_tokens += 1
            sampled.append([token_id])
            logprobs.append(None if state.params.logprobs is None else [self._logprobs(state)])
        self.last_work = StepWork(num_prefill, num_decodes, num_redone)
        return ModelRunnerOutput(req_ids, sampled, logprobs)

    # --- the batch, from deltas -----------------------------------------------------------

    def _update(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids:
            self._requests.pop(request_id, None)
            self._generators.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            previous = self._requests.get(new.request_id)
            self._requests[new.request_id] = _RequestState(
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_output_tokens=len(new.output_token_ids),
                num_computed_tokens=new.num_computed_tokens,
                params=new.sampling_params,
                stop_token_ids=new.stop_token_ids,
                max_computed_tokens=previous.max_computed_tokens if previous else 0,
            )
            if new.sampling_params.seed is not None and new.request_id not in self._generators:
                self._generators[new.request_id] = random.Random(new.sampling_params.seed)
        for cached in out.scheduled_cached_reqs:
            self._requests[cached.request_id].num_computed_tokens = cached.num_computed_tokens

    # --- the mock model -------------------------------------------------------------------

    def _sample(self, request_id: str, state: _RequestState, mask: Sequence[int] | None) -> int:
        answer_len = self.answer_lens.get(request_id)
        below_min = state.num_output_tokens < state.params.min_tokens
        if answer_len is not None and state.num_output_tokens + 1 >= answer_len and not below_min:
            return self.eos_token_id
        if state.params.temperature == 0.0:
            start = len(state.token_ids) % len(self.script)
        else:
            rng = self._generators.get(request_id, self._rng)
            start = rng.randrange(len(self.script))
        held_back = state.stop_token_ids if below_min else ()
        for offset in range(len(self.script)):
            token_id = self.script[(start + offset) % len(self.script)]
            if token_id not in held_back and (mask is None or _allows(mask, token_id)):
                return token_id
        if mask is not None:  # the grammar allows nothing the script writes (EOS, say)
            return next(t for t in range(self.vocab_size) if _allows(mask, t))
        raise AssertionError("every script token is a stop token below min_tokens")

    def _logprobs(self, state: _RequestState) -> TokenLogprobs:
        k = state.params.logprobs or 0
        token_id = state.token_ids[-1]
        position = len(state.token_ids)
        others = [self.script[(position + i) % len(self.script)] for i in range(k)]
        return TokenLogprobs([token_id, *others], [-0.5, *([-1.5] * k)], 1)


def _allows(mask_row: Sequence[int], token_id: int) -> bool:
    """Bit token_id of a grammar bitmask row (32 tokens per int32 word)."""
    return bool((int(mask_row[token_id // 32]) >> (token_id % 32)) & 1)
