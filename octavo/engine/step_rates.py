"""StepRates: the engine's measured step rates, and the time to first token they predict for a
request submitted now (--max-queue-wait sheds on it: engine/queue_limits.py).

A stat logger: each step's IterationStats carries its time and its prompt-chunk tokens. Two
exponentially weighted averages come of them:

    decode_step_s    the time of a step that runs no prompt token (every running request
                     decoding one token): what a step costs before any prompt token
    prompt_token_s   the time one prompt token adds to a step: (step time - decode_step_s)
                     / prompt tokens, over the steps that run prompt chunks

A request whose prompt has P tokens, submitted while Q prompt tokens are ahead of it (the
frontend's tally of prompts not yet prefilled) and D requests run, gets its first token once
the Q + P tokens have run. A step holds `max_num_batched_tokens` tokens, D of them decodes, so
that takes

    steps = ceil((Q + P) / (max_num_batched_tokens - D))    (at least ceil(P / cap) while
                                                             streams decode and prompt chunks
                                                             are capped at cap tokens)
    predicted TTFT = steps * decode_step_s + (Q + P) * prompt_token_s

With data-parallel replicas the work ahead is shared among them. The prediction counts
compute only, not a wait for a free seat (max_num_seqs) or for free KV blocks: it is a lower
bound, so it sheds no request that could have been served in time by compute alone.

Until a step with prompt tokens has been measured (cold start) there is no prediction (None),
and nothing is shed. Written by the thread that records stats (the engine thread, or the
engine-core client's output thread), read on the event loop: single float assignments, each
read whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from octavo.metrics.stats import IterationStats, SchedulerStats

# Weight of the newest step in the averages: about the last ten steps count.
EWMA_WEIGHT = 0.2


@dataclass(slots=True)
class StepShape:
    """What the engine's step can hold (SchedulerConfig's), for the prediction."""

    max_num_batched_tokens: int
    # Prompt tokens one prompt runs per step while streams decode (0: no cap).
    long_prefill_token_threshold: int = 0
    num_replicas: int = 1


class StepRates:
    def __init__(self, shape: StepShape, weight: float = EWMA_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}.")
        self.shape = shape
        self.weight = weight
        # Seconds; None until measured.
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None
        # Running requests at each replica's latest step.
        self._num_running: dict[int, int] = {}
        # Tokens (prompt chunks and decodes) and output tokens per second of step time, over
        # recent steps (what the engine runs at while busy); None until measured.
        self.tokens_per_s: float | None = None
        self.generation_tokens_per_s: float | None = None

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats,
        engine_index: int = 0,
    ) -> None:
        """One step's stats (StatLogger); snapshots that are no step change only the count of
        running requests."""
        self._num_running[engine_index] = scheduler_stats.num_running_reqs
        step_time_s = iteration_stats.step_time_s
        if step_time_s <= 0.0 or iteration_stats.num_scheduled_tokens <= 0:
            return
        num_prompt = iteration_stats.num_scheduled_prompt_tokens
        if num_prompt == 0:
            self.decode_step_s = self._average(self.decode_step_s, step_time_s)
        else:
            fixed_s = self.decode_step_s or 0.0
            per_token_s = max(step_time_s - fixed_s, 0.0) / num_prompt
            self.prompt_token_s = self._average(self.prompt_token_s, per_token_s)
        self.tokens_per_s = self._average(
            self.tokens_per_s, iteration_stats.num_scheduled_tokens / step_time_s
        )
        self.generation_tokens_per_s = self._average(
            self.generation_tokens_per_s, iteration_stats.num_generation_tokens / step_time_s
        )

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    @property
    def num_running_reqs(self) -> int:
        """Running requests at the latest steps, over all replicas."""
        return sum(self._num_running.values())

    @property
    def is_measured(self) -> bool:
        return self.prompt_token_s is not None

    def predict_ttft_s(self, num_prompt_tokens_ahead: int, num_prompt_tokens: int) -> float | None:
        """Seconds until the first token of a request of `num_prompt_tokens` submitted behind
        `num_prompt_tokens_ahead` (see the module's formula); None before any measurement."""
        if self.prompt_token_s is None:
            return None
        shape = self.shape
        replicas = max(shape.num_replicas, 1)
        num_tokens = num_prompt_tokens_ahead / replicas + num_prompt_tokens
        num_decodes = self.num_running_reqs / replicas
        room = max(shape.max_num_batched_tokens - num_decodes, 1.0)
        num_steps = math.ceil(num_tokens / room)
        cap = shape.long_prefill_token_threshold
        if cap and num_decodes:
            num_steps = max(num_steps, math.ceil(num_prompt_tokens / cap))
        return num_steps * (self.decode_step_s or 0.0) + num_tokens * self.prompt_token_s
