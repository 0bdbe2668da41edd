"""Admission policies: what must hold before a waiting request starts, and whom to evict
when a running request cannot get a block.

A policy is consulted by the scheduler and decides nothing else: it never allocates, frees or
changes a request, and it reads the KV cache manager only through its public counters. The
scheduler keeps the mechanics that every policy shares (the blocks for the next chunk must be
free; preemption frees blocks and sends the victim back to the front of the waiting queue; a
step that preempted admits nothing).

Four policies, one per deployment (`--admission`): three known servers' answers to "how much
KV must be free for an answer nobody has written yet", and one of octavo's own:

- `current` (vLLM): only the next chunk's blocks, plus a watermark. Full pool, but a running
  request that finds no block evicts the newest one, which recomputes later.
- `reserve` (TGI): the whole prompt + max_tokens of every running request. Never evicts; the
  price is queueing (time to first token) and idle capacity when answers end early.
- `ratio` (SGLang): each running request's clipped remaining answer x a ratio that learns from
  evictions. Victim: the request with the least output (it loses the least work).
- `forecast` (octavo): the batch's predicted peak, from answer lengths learned online (see
  ForecastPolicy), must fit; an evicted request is readmitted ahead of new ones as soon as
  its blocks are free, and the victim is the one whose eviction a client notices least.

Every policy also keeps `watermark` of the pool free at admission, and takes a victim rule
that `--preempt-victim` may override. Under `--scheduling-policy priority` every policy takes
vLLM's priority rule instead (`priority_victim`: the least important, latest request), so the
policies keep deciding how much must be free and the requests' priorities decide who is
evicted; `--preempt-victim` is refused with it (config.py).

Must not: import torch, measure time, or touch anything above `core`.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request

# Chooses a victim among the running requests (non-empty, oldest first).
VictimRule = Callable[[list[Request]], Request]


def newest_victim(running: list[Request]) -> Request:
    """vLLM's rule: the last admitted request has the least invested in it, in general."""
    return running[-1]


def least_output_victim(running: list[Request]) -> Request:
    """SGLang's rule: the fewest output tokens (the least decode work lost); among equals the
    longest prompt (it frees the most blocks), then the newest."""
    return min(reversed(running), key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens))


VICTIM_RULES: dict[str, VictimRule] = {
    "newest": newest_victim,
    "least-output": least_output_victim,
}


def priority_key(request: Request) -> tuple[int, float]:
    """The order of the priority scheduling policy (vLLM's): lower priority values first,
    then earlier arrivals."""
    return request.priority, request.arrival_time


def priority_victim(running: list[Request]) -> Request:
    """vLLM's rule under the priority scheduling policy: the running request of the largest
    (priority, arrival time), the least important and, among equals, the latest to arrive."""
    return max(running, key=priority_key)


@dataclass(frozen=True, slots=True)
class AdmissionCandidate:
    """The waiting request the scheduler would admit next, and what its admission takes."""

    request: Request
    # Tokens of its first chunk this step, starting right after the prefix-cache hits.
    num_new_tokens: int
    # Tokens covered by prefix-cache hits (whole blocks).
    num_hit_tokens: int
    # Hit blocks that sit in the free queue: taking them lowers the free count too.
    num_free_hit_blocks: int


class AdmissionPolicy(abc.ABC):
    """The interface the scheduler calls; one instance per scheduler, may keep state."""

    @abc.abstractmethod
    def can_admit(
        self,
        candidate: AdmissionCandidate,
        running: list[Request],
        kv_cache_manager: KVCacheManager,
    ) -> bool:
        """Whether the waiting `candidate.request` may start this step.

        Called for the request at the front of the waiting queue, after its prefix-cache hits
        have been looked up and before any block is allocated; `running` (oldest first)
        includes the requests admitted earlier in this step. It is an extra condition: the
        scheduler still requires the chunk's blocks to be free. False keeps the request, and
        every one behind it, waiting this step. Must not mutate anything.
        """

    @abc.abstractmethod
    def select_victim(self, running: list[Request]) -> Request:
        """The request to preempt when a running request cannot get a block.

        `running` is non-empty, in admission order (oldest first), and includes the request
        that needs the block; returning that request means it preempts itself. Must return a
        member of `running` and mutate nothing: the scheduler does the preemption.
        """

    def observe_step(self, running: list[Request], num_preempted: int) -> None:  # noqa: B027
        """Called once at the end of every `schedule()` with the requests left running and
        how many were preempted in that step. Policies that learn update their state here;
        must not mutate the requests."""


def _watermark_blocks(watermark: float, kv_cache_manager: KVCacheManager) -> int:
    return int(watermark * kv_cache_manager.num_blocks)


def _check_watermark(watermark: float) -> None:
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}.")


class CurrentPolicy(AdmissionPolicy):
    """vLLM's rule: admit while the chunk's blocks are free and, after taking them, at least
    `watermark` of the pool stays free; evict the newest running request.

    The watermark keeps room for running requests to grow into, so that an admission does
    not cause a preemption right away. Hits on free cached blocks are not counted against
    it: those blocks hold the request's own prefix, which it needs in any case.
    """

    def __init__(self, watermark: float = 0.0, victim: VictimRule = newest_victim) -> None:
        _check_watermark(watermark)
        self.watermark = watermark
        self.victim = victim

    def can_admit(
        self,
        candidate: AdmissionCandidate,
        running: list[Request],
        kv_cache_manager: KVCacheManager,
    ) -> bool:
        if self.watermark == 0.0:
            return True
        kv = kv_cache_manager
        num_chunk_blocks = -(-candidate.num_new_tokens // kv.block_size) * kv.num_groups
        return kv.num_free_blocks - num_chunk_blocks >= _watermark_blocks(self.watermark, kv)

    def select_victim(self, running: list[Request]) -> Request:
        return self.victim(running)


# --- reserving policies -----------------------------------------------------------------------


def _num_blocks_to_grow(request: Request, num_answer_tokens: int, kv: KVCacheManager) -> int:
    """Blocks the request would still take from the pool to hold every token it knows plus
    `num_answer_tokens` more, beyond the blocks it holds (shared ones included), in every KV
    cache group (a sliding group's counted as if it kept them all: an upper bound)."""
    num_final_tokens = request.num_tokens + num_answer_tokens
    num_held_blocks = len(kv.get_block_ids(request.request_id))
    return max(-(-num_final_tokens // kv.block_size) - num_held_blocks, 0) * kv.num_groups


def _fits_beside_reservations(
    candidate: AdmissionCandidate,
    num_candidate_answer_tokens: int,
    reservations: Iterable[tuple[Request, int]],
    kv: KVCacheManager,
    watermark: float,
) -> bool:
    """Whether the candidate's whole reservation fits in the free blocks left after every
    running request's reservation (`reservations`: request, answer tokens still reserved).

    Counting what each request still has to grow (not what it holds) keeps shared prefix
    blocks counted once. The candidate's hits on free cached blocks leave the free queue
    without lowering anybody's growth, so they are charged to it.

        free blocks: |<- running requests' growth ->|<- candidate: growth + free hits ->| >= 0
    """
    request = candidate.request
    num_reserved = sum(_num_blocks_to_grow(r, n, kv) for r, n in reservations)
    num_final_tokens = request.num_tokens + num_candidate_answer_tokens
    num_hit_blocks = candidate.num_hit_tokens // kv.block_size
    num_needed = (-(-num_final_tokens // kv.block_size) - num_hit_blocks) * kv.num_groups
    num_needed += candidate.num_free_hit_blocks
    num_available = kv.num_free_blocks - num_reserved - _watermark_blocks(watermark, kv)
    return num_needed <= num_available


def _remaining_answer(request: Request) -> int:
    return max(request.max_tokens - request.num_output_tokens, 0)


class ReservePolicy(AdmissionPolicy):
    """TGI's rule: a request starts only when its prompt + max_tokens fit beside every running
    request's own prompt + max_tokens. Nothing can then run out of blocks, so it never evicts.

    An empty batch always takes the candidate: the engine keeps prompt + max_tokens within
    max_model_len, which fits the pool, and refusing it would stall the queue for good.
    """

    def __init__(self, watermark: float = 0.0, victim: VictimRule = newest_victim) -> None:
        _check_watermark(watermark)
        self.watermark = watermark
        # Only reached if the engine's sizing guarantee is broken (a request larger than the
        # pool); kept so that the scheduler still makes progress then.
        self.victim = victim

    def can_admit(
        self,
        candidate: AdmissionCandidate,
        running: list[Request],
        kv_cache_manager: KVCacheManager,
    ) -> bool:
        if not running:
            return True
        reservations = ((r, _remaining_answer(r)) for r in running)
        return _fits_beside_reservations(
            candidate,
            _remaining_answer(candidate.request),
            reservations,
            kv_cache_manager,
            self.watermark,
        )

    def select_victim(self, running: list[Request]) -> Request:
        return self.victim(running)


class RatioPolicy(AdmissionPolicy):
    """SGLang's rule: reserve, per running request, its remaining answer (max_tokens minus the
    output so far, clipped at `clip_tokens`) times `ratio`; the candidate must fit with its
    whole clipped answer.

    The ratio is an estimate of how much of max_tokens answers really use. It starts at
    `init_ratio` and, every step that evicts nothing while requests run, decays by
    (init_ratio - min_ratio) / decay_steps down to `min_ratio`: memory was enough, so admit
    more. After a step that evicted it is reset from what the requests left running used:
    (their output so far + `reset_headroom_tokens` each) / (their clipped max_tokens),
    kept within [min_ratio, 1]. With nothing left running it goes back to `init_ratio`.
    Victim: the request with the least output.
    """

    def __init__(
        self,
        watermark: float = 0.0,
        victim: VictimRule = least_output_victim,
        init_ratio: float = 0.7,
        min_ratio: float = 0.1,
        decay_steps: int = 600,
        clip_tokens: int = 4096,
        reset_headroom_tokens: int = 20,
    ) -> None:
        _check_watermark(watermark)
        if not 0.0 < min_ratio <= init_ratio <= 1.0:
            raise ValueError(
                f"need 0 < min_ratio <= init_ratio <= 1, got {min_ratio} and {init_ratio}."
            )
        if decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {decay_steps}.")
        self.watermark = watermark
        self.victim = victim
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay = (init_ratio - min_ratio) / decay_steps
        self.clip_tokens = clip_tokens
        self.reset_headroom_tokens = reset_headroom_tokens
        self.ratio = init_ratio

    def _reserved_answer(self, request: Request) -> int:
        # Rounded before the ceiling so that 0.7 * 10 reserves 7 tokens, not 8.
        return math.ceil(round(min(_remaining_answer(request), self.clip_tokens) * self.ratio, 6))

    def can_admit(
        self,
        candidate: AdmissionCandidate,
        running: list[Request],
        kv_cache_manager: KVCacheManager,
    ) -> bool:
        if not running:
            return True
        reservations = ((r, self._reserved_answer(r)) for r in running)
        return _fits_beside_reservations(
            candidate,
            min(_remaining_answer(candidate.request), self.clip_tokens),
            reservations,
            kv_cache_manager,
            self.watermark,
        )

    def select_victim(self, running: list[Request]) -> Request:
        return self.victim(running)

    def observe_step(self, running: list[Request], num_preempted: int) -> None:
        if num_preempted:
            self.ratio = self._ratio_from_usage(running)
        elif running:
            self.ratio = max(self.ratio - self.decay, self.min_ratio)

    def _ratio_from_usage(self, running: list[Request]) -> float:
        num_max_tokens = sum(min(r.max_tokens, self.clip_tokens) for r in running)
        if num_max_tokens == 0:
            return self.init_ratio
        num_used = sum(r.num_output_tokens + self.reset_headroom_tokens for r in running)
        return min(max(num_used / num_max_tokens, self.min_ratio), 1.0)


# --- forecast: admit against the predicted peak, learned from ended requests -------------------


class AnswerLengths:
    """The output lengths of the last `window` requests that ended (finished or aborted),
    kept sorted, for quantiles of how much longer a running request will go on."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        self.window = window
        self._order: deque[int] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, num_output_tokens: int) -> None:
        self._order.append(num_output_tokens)
        bisect.insort(self._sorted, num_output_tokens)
        if len(self._order) > self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self._order.popleft())]

    def remaining(self, num_output_tokens: int, q: float) -> int | None:
        """The q-quantile of (length - num_output_tokens) over the ended requests that went
        beyond num_output_tokens; None if none did."""
        first = bisect.bisect_right(self._sorted, num_output_tokens)
        num_longer = len(self._sorted) - first
        if num_longer == 0:
            return None
        return self._sorted[first + max(math.ceil(q * num_longer), 1) - 1] - num_output_tokens


class ForecastPolicy(AdmissionPolicy):
    """octavo's own rule: admit when the KV the batch is *predicted* to need at its peak fits,
    with the prediction learned from how long answers really were.

    Why: `current` fills the pool with prompts and pays with evictions once answers grow;
    `reserve` and `ratio` charge every request for an answer as long as max_tokens (or a
    share of it), which clients set far above what answers use, so the pool sits idle.
    Neither looks at the two facts the scheduler can know: the lengths of the answers that
    ended recently, and that requests end at different times and give their blocks back.

    - Each running request's remaining answer is the q-quantile of (length - output so far)
      over the last `window` ended requests that got further than it (heavy tails make a
      request that is already long likely to go on), capped by its own max_tokens. One that
      is longer than every ended request is expected to double (as long again as it is).
      Until `min_samples` requests have ended, answers are taken as max_tokens x
      `cold_ratio`.
    - The forecast is a schedule, not a sum: every running request (and the candidate) grows
      by a token per step until its predicted end, then frees its blocks. The peak of that
      schedule, over the moments just before each predicted end, must fit in the free blocks
      (less the watermark). Counting blocks still to grow keeps shared prefixes counted once.
    - q adapts: each step that evicts raises it by `q_step` (towards 1: predict longer answers),
      each `q_decay_steps` steps without an eviction while requests run lower it by one step,
      never below `q_min`.
    - When a request must still be evicted, the victim is the one whose eviction costs its
      client least (`least_harm_victim`): a request whose stream has shown nothing yet (no
      output) first, else the one with the fewest tokens to recompute.
    """

    def __init__(
        self,
        watermark: float = 0.0,
        victim: VictimRule | None = None,
        q_min: float = 0.5,
        q_step: float = 0.1,
        q_decay_steps: int = 200,
        window: int = 1000,
        min_samples: int = 16,
        cold_ratio: float = 0.7,
        readmit_evicted: bool = True,
    ) -> None:
        _check_watermark(watermark)
        if not 0.0 < q_min <= 1.0:
            raise ValueError(f"q_min must be in (0, 1], got {q_min}.")
        self.watermark = watermark
        self.victim = victim if victim is not None else least_harm_victim
        self.q_min = q_min
        self.q = q_min
        self.q_step = q_step
        self.q_decay_steps = q_decay_steps
        self.min_samples = min_samples
        self.cold_ratio = cold_ratio
        self.readmit_evicted = readmit_evicted
        self.lengths = AnswerLengths(window)
        self._steps_without_eviction = 0
        # The requests running at the last observed step, to see which have ended since.
        self._watched: dict[str, Request] = {}

    def predicted_remaining(self, request: Request) -> int:
        """Output tokens the request is expected to write from now on."""
        num_left = _remaining_answer(request)
        if len(self.lengths) < self.min_samples:
            return math.ceil(num_left * self.cold_ratio)
        num_output = request.num_output_tokens
        remaining = self.lengths.remaining(num_output, self.q)
        if remaining is None:
            remaining = max(num_output, 1)
        return min(remaining, num_left)

    def can_admit(
        self,
        candidate: AdmissionCandidate,
        running: list[Request],
        kv_cache_manager: KVCacheManager,
    ) -> bool:
        if not running or (self.readmit_evicted and candidate.request.num_preemptions):
            return True
        kv = kv_cache_manager
        bs = kv.block_size
        # (remaining answer, blocks held now, tokens known now) per request, the candidate's
        # hit blocks counted as held (shared ones) or to take (free ones, in the free queue).
        schedule = [
            (
                self.predicted_remaining(r),
                kv.num_held_blocks(r.request_id) / kv.num_groups,
                r.num_tokens,
            )
            for r in running
        ]
        request = candidate.request
        num_hit_blocks = candidate.num_hit_tokens // bs
        schedule.append(
            (
                self.predicted_remaining(request),
                num_hit_blocks - candidate.num_free_hit_blocks / kv.num_groups,
                request.num_tokens,
            )
        )
        available = (kv.num_free_blocks - _watermark_blocks(self.watermark, kv)) / kv.num_groups
        return _forecast_peak_blocks(schedule, bs) <= available

    def select_victim(self, running: list[Request]) -> Request:
        return self.victim(running)

    def observe_step(self, running: list[Request], num_preempted: int) -> None:
        for request in self._watched.values():
            if request.is_finished and request.num_output_tokens > 0:
                self.lengths.add(request.num_output_tokens)
        self._watched = {r.request_id: r for r in running}
        if num_preempted:
            self.q = min(self.q + self.q_step, 1.0)
            self._steps_without_eviction = 0
        elif running:
            self._steps_without_eviction += 1
            if self._steps_without_eviction >= self.q_decay_steps:
                self.q = max(self.q - self.q_step, self.q_min)
                self._steps_without_eviction = 0


def _forecast_peak_blocks(schedule: list[tuple[int, float, int]], block_size: int) -> float:
    """The most blocks, beyond those held now, that `schedule` (remaining tokens, blocks held,
    tokens known, per request) takes from the free pool at once, if every request grows a
    token per step and gives back all it holds when it ends.

    At T tokens from now, a request still alive has taken (tokens + T) / block_size - held
    blocks and one that ended has given back its held ones; the peak is reached just before
    one of the ends, so T runs over the remainings. Approximations, both small: blocks are
    fractional (at most one partial block per request), and a prefix block shared by several
    requests is counted as given back by each of them.
    """
    schedule = sorted(schedule)
    num_alive = len(schedule)
    # Alive requests' (tokens / block_size - held), summed over the suffix still alive.
    alive_offset = sum(tokens / block_size - held for _, held, tokens in schedule)
    returned = 0.0
    peak = 0.0
    for remaining, held, tokens in schedule:
        growth = alive_offset + num_alive * remaining / block_size
        peak = max(peak, growth - returned)
        # This request ends at `remaining`: it stops growing and gives back all it holds.
        alive_offset -= tokens / block_size - held
        num_alive -= 1
        returned += held
    return peak


def least_harm_victim(running: list[Request]) -> Request:
    """The eviction a client notices least: among requests with no output yet (nothing
    streamed, only a later first token), the newest; else the request with the fewest tokens
    to recompute (the shortest freeze), the newest among equals."""
    silent = [r for r in running if r.num_output_tokens == 0]
    if silent:
        return silent[-1]
    return min(reversed(running), key=lambda r: r.num_tokens)


# `--admission` name -> policy: the one list of them (settings, CLI and benchmarks read it).
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "current": CurrentPolicy,
    "reserve": ReservePolicy,
    "ratio": RatioPolicy,
    "forecast": ForecastPolicy,
}


def make_admission_policy(config: SchedulerConfig) -> AdmissionPolicy:
    """The policy a SchedulerConfig names, with its watermark and victim override (the
    priority scheduling policy's rule, or `preempt_victim`; config.py allows one at most)."""
    overrides = {}
    if config.scheduling_policy == "priority":
        overrides["victim"] = priority_victim
    elif config.preempt_victim is not None:
        overrides["victim"] = VICTIM_RULES[config.preempt_victim]
    if config.admission not in ADMISSION_POLICIES:
        raise ValueError(f"admission {config.admission!r} is not a known policy.")
    return ADMISSION_POLICIES[config.admission](config.watermark, **overrides)
