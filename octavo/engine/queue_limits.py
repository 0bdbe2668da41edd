"""QueueLimits: vLLM's --max-num-queued-reqs and --max-num-queued-tokens, the bounds on the work
the serving frontend has accepted and not finished, checked when a request is submitted.

Owns two tallies of what the frontend has handed to the engine: requests in flight (waiting or
running; a request with n > 1 counts n), and the prompt tokens of the requests whose prompt is
not done yet (no output has come back for them). A request that would pass a bound is rejected
at once with QueueOverflowError (the server answers 503), before anything of it reaches the
engine, so a load balancer can send it elsewhere. vLLM's rules: the request bound holds for the
tally with the new request in it; the token bound rejects once the tally has reached it (a
prompt larger than the bound is taken when nothing else is being prefilled).

octavo's wait bound, --max-queue-wait SECONDS: a request whose predicted time to first token
(StepRates.predict_ttft_s: the prompt tokens ahead of it, the running requests and the
engine's measured step rates) is over the bound is rejected too, told to retry after the
predicted wait. Before the rates are measured (cold start) it sheds nothing.

Lives on the event loop (AsyncEngine.generate) and needs no lock. Must not: look into the
scheduler (the counts are what the frontend has seen, as vLLM's are), or run for the offline
LLM, which submits every prompt at once (vLLM's LLM does not check them either).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from octavo.engine.step_rates import StepRates


class QueueOverflowError(RuntimeError):
    """A request was rejected because the frontend's queue bounds are reached; `reason` is the
    bound (metrics.stats.ADMISSION_REASONS); `retry_after_s`, when known, how long the client
    should wait before it retries (whole seconds, Retry-After's unit)."""

    def __init__(self, message: str, reason: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class QueueLimits:
    # None: no bound.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # Requests in flight (each counted n times) and prompt tokens not yet prefilled.
    num_reqs: int = 0
    num_prefill_tokens: int = 0
    # Told of each rejection's reason (the server's vllm:admission_rejections counter).
    on_reject: Callable[[str], None] | None = None
    # --max-queue-wait: the longest predicted time to first token admitted (None: no bound),
    # predicted from `step_rates` (None: nothing is predicted).
    max_queue_wait_s: float | None = None
    step_rates: StepRates | None = None

    def check(self, num_reqs: int, num_prompt_tokens: int = 0) -> None:
        """Raise QueueOverflowError if `num_reqs` more requests, with `num_prompt_tokens`
        prompt tokens in all, may not be admitted now."""
        limit = self.max_num_queued_reqs
        if limit is not None and self.num_reqs + num_reqs > limit:
            self._reject(
                f"The server is at its limit of {limit} requests in flight "
                f"(--max-num-queued-reqs); {self.num_reqs} are running or waiting, this one "
                f"asks for {num_reqs}. Retry later.",
                "max_num_queued_reqs",
            )
        limit = self.max_num_queued_tokens
        if limit is not None and self.num_prefill_tokens >= limit:
            self._reject(
                f"The server is at its limit of {limit} prompt tokens waiting to be processed "
                f"(--max-num-queued-tokens); {self.num_prefill_tokens} are. Retry later.",
                "max_num_queued_tokens",
            )
        self._check_wait(num_prompt_tokens)

    def predict_ttft_s(self, num_prompt_tokens: int) -> float | None:
        """The predicted time to first token of a request of `num_prompt_tokens` submitted
        now; None before the step rates are measured."""
        if self.step_rates is None:
            return None
        return self.step_rates.predict_ttft_s(self.num_prefill_tokens, num_prompt_tokens)

    def _check_wait(self, num_prompt_tokens: int) -> None:
        limit = self.max_queue_wait_s
        if limit is None:
            return
        wait_s = self.predict_ttft_s(num_prompt_tokens)
        if wait_s is None or wait_s <= limit:
            return
        retry_after_s = max(math.ceil(wait_s), 1)
        self._reject(
            f"The predicted time to first token of this request is {wait_s:.2f} s "
            f"({self.num_prefill_tokens} prompt tokens ahead of its {num_prompt_tokens}), over "
            f"the server's limit of {limit:g} s (--max-queue-wait). Retry in "
            f"{retry_after_s} s.",
            "max_queue_wait",
            retry_after_s,
        )

    def _reject(self, message: str, reason: str, retry_after_s: int | None = None) -> None:
        if self.on_reject is not None:
            self.on_reject(reason)
        raise QueueOverflowError(message, reason, retry_after_s)

    def admit(self, num_reqs: int, num_prompt_tokens: int) -> None:
        """check, then count the request in."""
        self.check(num_reqs, num_prompt_tokens)
        self.num_reqs += num_reqs
        self.num_prefill_tokens += num_prompt_tokens

    def prefilled(self, num_prompt_tokens: int) -> None:
        """A request's prompt is done (its first output came back)."""
        self.num_prefill_tokens -= num_prompt_tokens

    def finished(self, num_reqs: int) -> None:
        """A request has finished (or was aborted, or failed)."""
        self.num_reqs -= num_reqs
