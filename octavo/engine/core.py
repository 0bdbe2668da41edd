"""EngineCore: the part of the engine that runs the model, on either side of the process
boundary: the scheduler, the model runner, grammar compilation and the per-request timing.

    add_request(EngineCoreRequest) / abort_requests(ids) / step() -> EngineCoreStep

A step is schedule -> grammar bitmask -> execute -> update. Between steps the core can sleep
(vLLM's sleep mode: `sleep(level)` / `wake_up(tags)`, its memory released while it takes no
step) and run the torch profiler (`start_profile` / `stop_profile`). What it returns is plain data
(token ids, finish reasons, the step's stats), so that the same step crosses a process boundary
as one message (octavo/engine/core_proc.py) or goes straight to the OutputProcessor of an
in-process LLMEngine.

Must not: tokenize, detokenize or look at text: stop strings are found by the frontend, which
ends those requests with `abort_requests(ids, stopped=True)`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from octavo.config import EngineConfig
from octavo.core.kv_view import kv_snapshot
from octavo.core.outputs import EngineCoreOutput
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import FinishReason, Request, ResolvedParams
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput
from octavo.metrics.stats import IterationStats, SchedulerStats
from octavo.metrics.tracker import RequestStatsTracker
from octavo.structured_output import StructuredOutputManager
from octavo.worker.model_runner import ModelRunner
from octavo.worker.profiler import TorchProfiler

logger = logging.getLogger(__name__)

# Longest an idle step waits for a grammar to compile; new commands (adds, aborts) are read
# between steps, so this bounds how late the step loop sees them.
_GRAMMAR_WAIT_S = 0.01

# vLLM's sleep levels: 0 pauses the steps only; 1 also forgets the KV cache and releases its
# memory; 2 releases the weights too (reloaded from the model files at wake-up).
SLEEP_LEVELS = (0, 1, 2)
# What to do with the requests in flight when sleep is called: vLLM's "abort" (its default;
# vLLM's "wait" and "keep" are not implemented).
SLEEP_MODES = ("abort",)
# What wake_up restores, vLLM's tags; the core steps again once none is left asleep.
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


def check_sleep(level: int, mode: str, enable_sleep_mode: bool) -> None:
    """ValueError naming the parameter if `sleep(level, mode)` cannot be done (frontends check
    before they abort anything)."""
    if not enable_sleep_mode:
        raise ValueError("sleep needs enable_sleep_mode=True (--enable-sleep-mode).")
    if level not in SLEEP_LEVELS:
        raise ValueError(f"level must be one of 0, 1, 2; got {level!r}.")
    if mode not in SLEEP_MODES:
        raise ValueError(
            f"mode must be 'abort' (vLLM's 'wait' and 'keep' are not implemented); got {mode!r}."
        )


def check_wake_up_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The tags to wake (None: all), or ValueError naming an unknown one."""
    if tags is None:
        return WAKE_UP_TAGS
    tags = tuple(tags)
    unknown = [tag for tag in tags if tag not in WAKE_UP_TAGS]
    if unknown:
        raise ValueError(
            f"tags must be among {', '.join(WAKE_UP_TAGS)}; got {', '.join(map(repr, unknown))}."
        )
    return tags


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One output stream to run (a child of an n > 1 request is one of its own), checked and
    resolved by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    resolved: ResolvedParams
    arrival_time: float
    # vLLM's: lower runs earlier under the priority scheduling policy (the frontend has
    # refused anything but 0 under fcfs).
    priority: int = 0
    # Set for a pooling request (resolved by the frontend); its sampling_params only carry
    # what every request has (output kind, n = 1).
    pooling_params: PoolingParams | None = None


@dataclass(frozen=True, slots=True)
class EngineCoreStep:
    """What one step did: each request's new tokens and finishes."""

    outputs: list[EngineCoreOutput]
    num_scheduled_tokens: int


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.config = config
        self.model_runner = model_runner
        self.scheduler = Scheduler(
            config.scheduler, config.cache, speculative_config=config.speculative
        )
        self.structured_output = StructuredOutputManager(
            tokenizer,
            model_runner.vocab_size,
            eos_token_ids,
            reasoning_parser=config.reasoning_parser,
        )
        self.stats_tracker = RequestStatsTracker()
        # What sleep released and wake_up has not restored yet (WAKE_UP_TAGS); empty: awake.
        self._sleeping_tags: set[str] = set()
        # The level of the sleep in progress (SchedulerStats.sleep_level); None: awake.
        self._sleep_level: int | None = None
        profiler = config.profiler_config
        self.profiler = TorchProfiler(profiler) if profiler else None

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one request; its grammar (if any) starts compiling off the step loop. Raises
        ValueError (a grammar that does not compile) with nothing queued."""
        params = request.sampling_params
        grammar = (
            None
            if params.structured_outputs is None
            else self.structured_output.grammar_for(
                params.structured_outputs, request.prompt_token_ids
            )
        )
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                params,
                request.resolved,
                request.arrival_time,
                grammar,
                request.priority,
                request.pooling_params,
            )
        )
        self.stats_tracker.add_request(
            request.request_id,
            request.arrival_time,
            len(request.prompt_token_ids),
            request.resolved.max_tokens,
        )

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """End requests in any state; their blocks return to the pool at once. `stopped`: they
        hit a stop string (their callers see STOP, the stats count them so)."""
        self.scheduler.abort_requests(request_ids)
        now = time.monotonic()
        reason = FinishReason.STOP if stopped else FinishReason.ABORT
        for request_id in request_ids:
            self.stats_tracker.record_finished(request_id, reason, now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreStep:
        """One step (none while asleep: an empty one). Its events go to the stats tracker;
        `take_iteration_stats` collects them (after the frontend's stop-string aborts of the
        same step, in process)."""
        if self._sleeping_tags:
            return EngineCoreStep([], 0)
        step_start_time = time.monotonic()
        scheduler_output = self._with_grammar_bitmask(self.scheduler.schedule())
        runner_output = self.model_runner.execute(scheduler_output)
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self._record_events(step_start_time, scheduler_output, outputs)
        return EngineCoreStep(outputs, scheduler_output.total_num_scheduled_tokens)

    def take_iteration_stats(self, num_scheduled_tokens: int = 0) -> IterationStats:
        """Everything recorded since the last call (steps, aborts), as one IterationStats."""
        return self.stats_tracker.take_iteration_stats(num_scheduled_tokens)

    def _with_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step's output with the allowed-token bitmask of its sampling structured
        requests. With nothing scheduled while grammars compile, wait a little for one
        instead of letting the step loop spin."""
        req_ids = scheduler_output.structured_output_req_ids
        if not req_ids:
            if scheduler_output.is_empty:
                self.structured_output.wait_for_pending(_GRAMMAR_WAIT_S)
            return scheduler_output
        grammars = []
        for request_id in req_ids:
            request = self.scheduler.get_request(request_id)
            assert request is not None and request.grammar is not None, request_id
            grammars.append(request.grammar)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self.structured_output.grammar_bitmask(
            grammars, [drafts.get(request_id, []) for request_id in req_ids]
        )
        return dataclasses.replace(scheduler_output, grammar_bitmask=bitmask)

    def _record_events(
        self,
        step_start_time: float,
        scheduler_output: SchedulerOutput,
        outputs: list[EngineCoreOutput],
    ) -> None:
        """Scheduling and evictions are stamped with the step's start, tokens and finishes
        with its end (when the outputs are ready for callers)."""
        now = time.monotonic()
        tracker = self.stats_tracker
        # A request running one token is decoding; any other runs a prompt chunk.
        tracker.record_step(
            now - step_start_time,
            sum(n for n in scheduler_output.num_scheduled_tokens.values() if n > 1),
        )
        tracker.record_scheduled(
            (new_req.request_id for new_req in scheduler_output.scheduled_new_reqs),
            step_start_time,
        )
        tracker.record_preempted(scheduler_output.preempted_req_ids, step_start_time)
        # Blocks are taken and found by prefix hits while scheduling.
        tracker.record_block_events(self.scheduler.take_residency_events(), step_start_time)
        for output in outputs:
            tracker.record_tokens(
                output.request_id, len(output.new_token_ids), now, output.num_cached_tokens
            )
            if output.finish_reason is not None:
                tracker.record_finished(output.request_id, output.finish_reason, now)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # --- sleep mode and the profiler ------------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep: take no step until wake_up. Every request still here is aborted first
        (its blocks freed; telling its caller is the frontend's business, which aborts its own
        requests before calling this). Level 0 releases nothing; level 1 also forgets the
        prefix cache and releases the KV cache's memory; level 2 the weights too (the runner
        reloads them at wake-up). Already asleep: logged, nothing changes (vLLM's rule).
        ValueError (check_sleep) where sleep mode is off or the level or mode is unknown."""
        check_sleep(level, mode, self.config.enable_sleep_mode)
        if self._sleeping_tags:
            logger.warning("sleep(level=%d): the engine is already asleep", level)
            return
        start = time.perf_counter()
        self.abort_requests(list(self.scheduler.requests))
        if level == 0:
            self._sleeping_tags = {"scheduling"}
        else:
            # Every block is free now: the cached prefixes go with the KV cache's contents.
            reset = self.scheduler.reset_prefix_cache()
            assert reset, "blocks still held after every request was aborted"
            self.model_runner.sleep(level)
            _collect_garbage()
            self._sleeping_tags = set(WAKE_UP_TAGS)
        self._sleep_level = level
        duration_s = time.perf_counter() - start
        self.stats_tracker.record_sleep_mode_operation("sleep", duration_s)
        logger.info("asleep at level %d in %.2f s", level, duration_s)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what sleep released among `tags` (None: everything; vLLM's tags "weights",
        "kv_cache", "scheduling"); the core steps again once every tag is awake. Requests added
        while asleep waited and run then. Not asleep: logged, nothing changes."""
        tags = check_wake_up_tags(tags)
        if not self._sleeping_tags:
            logger.warning("wake_up: the engine is not asleep")
            return
        start = time.perf_counter()
        self.model_runner.wake_up([tag for tag in tags if tag != "scheduling"])
        self._sleeping_tags.difference_update(tags)
        _collect_garbage()
        if not self._sleeping_tags:
            self._sleep_level = None
        duration_s = time.perf_counter() - start
        self.stats_tracker.record_sleep_mode_operation("wake", duration_s)
        logger.info(
            "woke %s in %.2f s%s",
            ", ".join(tags),
            duration_s,
            f"; still asleep: {', '.join(sorted(self._sleeping_tags))}"
            if self._sleeping_tags
            else "",
        )

    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    def start_profile(self) -> None:
        """Start the torch profiler (RuntimeError where none is configured, as vLLM's)."""
        self._profiler().start()

    def stop_profile(self) -> None:
        """Stop it and write the trace to its folder."""
        self._profiler().stop()

    def _profiler(self) -> TorchProfiler:
        if self.profiler is None:
            raise RuntimeError(
                "Profiler is not enabled: set profiler_config (--profiler-config) or "
                "VLLM_TORCH_PROFILER_DIR."
            )
        return self.profiler

    def make_stats(self) -> SchedulerStats:
        """The scheduler's snapshot, with the engine's sleep level."""
        return dataclasses.replace(self.scheduler.make_stats(), sleep_level=self._sleep_level)

    def kv_snapshot(self) -> dict[str, Any]:
        """What the KV cache holds and who holds it (core/kv_view.py), with the sleep level."""
        return {**kv_snapshot(self.scheduler), "sleep_level": self._sleep_level}

    def check_integrity(self) -> None:
        """Raise AssertionError if the scheduler's queues or the block pool disagree."""
        self.scheduler.check_integrity()

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker has gone)."""
        self.model_runner.check_health()

    def shutdown(self) -> None:
        if self.profiler is not None and self.profiler.is_running:
            self.profiler.stop()
        self.structured_output.shutdown()
        self.model_runner.shutdown()


def _collect_garbage() -> None:
    """Free what sleep released now, cycles included (a model holds some), and keep the
    collector off what remains or was loaded again (see freeze_startup_objects: start-up froze
    its objects, which a collection would otherwise never free)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
