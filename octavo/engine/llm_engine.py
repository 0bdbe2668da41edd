"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the output
processor. `step()` is the one data flow of the engine:

    schedule -> grammar bitmask -> execute -> update -> process_outputs

The bitmask holds the allowed tokens of this step's sampling structured-output requests; their
grammars are compiled off the step loop by the StructuredOutputManager.

The engine owns no policy of its own: admission lives in the scheduler, tensors in the runner,
text in the output processor. It fans `n > 1` out into child requests, which the scheduler
sees as independent streams sharing the prompt's cached blocks.

It is the layer that reads the clock for stats: each step it reports to its
RequestStatsTracker when requests were scheduled, evicted, got tokens and finished, and hands
the step's SchedulerStats and IterationStats to its stat loggers (Prometheus, request log).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time

from transformers import PreTrainedTokenizerBase

from octavo.config import EngineArgs, EngineConfig, capacity_line, weights_line
from octavo.core.outputs import EngineCoreOutput
from octavo.core.request import FinishReason, Request
from octavo.core.sampling_params import SamplingParams
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput
from octavo.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from octavo.engine.output_processor import OutputKind, OutputProcessor
from octavo.engine.outputs import RequestOutput
from octavo.metrics.request_log import RequestLogWriter
from octavo.metrics.stats import SchedulerStats, StatLogger
from octavo.metrics.tracker import RequestStatsTracker
from octavo.structured_output import StructuredOutputManager
from octavo.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Longest an idle step waits for a grammar to compile; new commands (adds, aborts) are read
# between steps, so this bounds how late the step loop sees them.
_GRAMMAR_WAIT_S = 0.01


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
        sampling_defaults: dict[str, float | int] | None = None,
    ) -> None:
        self.config = config
        # The model's generation_config.json sampling values (vLLM's defaults when unset).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.tokenizer = tokenizer
        self.model_runner = model_runner
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.structured_output = StructuredOutputManager(
            tokenizer, model_runner.vocab_size, eos_token_ids
        )
        self.input_processor = InputProcessor(
            tokenizer,
            config.scheduler.max_model_len,
            model_runner.vocab_size,
            eos_token_ids,
            self.structured_output,
            config.max_logprobs,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._request_counter = itertools.count()
        self.stats_tracker = RequestStatsTracker()
        self.stat_loggers: list[StatLogger] = []
        if config.request_log is not None:
            self.stat_loggers.append(RequestLogWriter(config.request_log))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Resolve `args` against this machine and model, build the worker, log the resolved
        configuration (the backend's choices included) as one JSON document and the KV
        capacity line, and return the engine."""
        # Imported here so that `octavo.engine` stays importable without loading a model.
        from octavo.engine.tokenizer import load_tokenizer
        from octavo.worker.setup import build_model_runner, probe

        facts = probe(args)
        config = args.create_engine_config(
            facts.platform, facts.model_config, facts.model_path, facts.weight_bytes
        )
        runner, backend = build_model_runner(config)
        config = dataclasses.replace(config, backend_choices=backend.describe())
        logger.info("dtype %s (%s)", config.dtype, config.dtype_reason)
        logger.info("resolved configuration: %s", config.to_json())
        logger.info(weights_line(backend.weights_report.get("bytes_by_type", {})))
        logger.info(
            capacity_line(
                config.cache,
                config.scheduler.max_model_len,
                config.scheduler.max_num_batched_tokens,
            )
        )
        model_config = runner.model_config
        sliding = model_config.sliding_layers
        if sliding and not any(config.cache.group_windows):
            # Honest about memory: windowed layers whose blocks are all the same kept.
            logger.info(
                "sliding window %d on %d of %d layers: every block of every layer is kept "
                "(--disable-hybrid-kv-cache-manager)",
                model_config.sliding_window,
                len(sliding),
                model_config.num_hidden_layers,
            )
        tokenizer = load_tokenizer(config.model, config.chat_template)
        eos = model_config.eos_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        engine = cls(config, runner, tokenizer, tuple(eos), dict(model_config.sampling_defaults))
        # What start-up built (the libraries' objects, modules, tokenizer: ~300,000 for the
        # embedded model) lives as long as the engine. Frozen, the collector's full passes no
        # longer walk it: each took ~0.15 s on two cores, a pause in every stream, and 1-2% of a
        # prompt-heavy run's CPU time.
        gc.collect()
        gc.freeze()
        return engine

    # --- requests -----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config defaults applied."""
        return SamplingParams(**self.sampling_defaults)

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        sampling_params: SamplingParams,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
    ) -> None:
        """Check and queue one request. Raises ValueError (naming the parameter) on bad input;
        nothing is queued then."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use.")
        processed = (
            prompt
            if isinstance(prompt, ProcessedPrompt)
            else self.input_processor.process_prompt(prompt)
        )
        params = sampling_params.clone()
        resolved = self.input_processor.resolve_params(params, len(processed.prompt_token_ids))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            children = [(request_id, params)]
            child_ids = None
        else:
            children = [(f"{i}_{request_id}", _child_params(params, i)) for i in range(params.n)]
            child_ids = [child_id for child_id, _ in children]
        # Each child advances its own grammar; the compilation is shared (and cached).
        grammars = [
            None
            if child_params.structured_outputs is None
            else self.structured_output.grammar_for(child_params.structured_outputs)
            for _, child_params in children
        ]
        self.output_processor.add_request(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            output_kind,
            child_ids,
        )
        for (child_id, child_params), grammar in zip(children, grammars):
            request = Request(
                child_id,
                processed.prompt_token_ids,
                child_params,
                resolved,
                arrival_time,
                grammar,
            )
            self.scheduler.add_request(request)
            self.stats_tracker.add_request(
                child_id, arrival_time, len(processed.prompt_token_ids), resolved.max_tokens
            )

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests in any state; their blocks return to the pool at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = self.output_processor.abort_requests(request_ids)
        self.scheduler.abort_requests(core_ids)
        now = time.monotonic()
        for core_id in core_ids:
            self.stats_tracker.record_finished(core_id, FinishReason.ABORT, now)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        step_start_time = time.monotonic()
        scheduler_output = self._with_grammar_bitmask(self.scheduler.schedule())
        runner_output = self.model_runner.execute(scheduler_output)
        core_outputs = self.scheduler.update(scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        # The one backward edge: stop strings found in the text end requests next step.
        self.scheduler.abort_requests(processed.reqs_to_abort)
        self._record_stats(step_start_time, scheduler_output, core_outputs, processed.reqs_to_abort)
        return processed.request_outputs

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
        bitmask = self.structured_output.grammar_bitmask(grammars)
        return dataclasses.replace(scheduler_output, grammar_bitmask=bitmask)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Hand every later step's stats to `stat_logger` (on the thread that steps)."""
        self.stat_loggers.append(stat_logger)

    def _record_stats(
        self,
        step_start_time: float,
        scheduler_output: SchedulerOutput,
        core_outputs: list[EngineCoreOutput],
        stopped_req_ids: list[str],
    ) -> None:
        """Scheduling and evictions are stamped with the step's start, tokens and finishes
        with its end (when the outputs are ready for callers)."""
        now = time.monotonic()
        tracker = self.stats_tracker
        tracker.record_scheduled(
            (new_req.request_id for new_req in scheduler_output.scheduled_new_reqs),
            step_start_time,
        )
        tracker.record_preempted(scheduler_output.preempted_req_ids, step_start_time)
        for output in core_outputs:
            tracker.record_tokens(output.request_id, len(output.new_token_ids), now)
            if output.finish_reason is not None:
                tracker.record_finished(output.request_id, output.finish_reason, now)
        # Stopped by a stop string: the scheduler saw an abort, the caller sees STOP.
        for request_id in stopped_req_ids:
            tracker.record_finished(request_id, FinishReason.STOP, now)
        iteration_stats = tracker.take_iteration_stats(scheduler_output.total_num_scheduled_tokens)
        if not self.stat_loggers:
            return
        scheduler_stats = self.scheduler.make_stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    child = params.clone()
    child.n = 1
    # A seeded parent gives each child its own stream (vLLM: seed + index).
    if params.seed is not None:
        child.seed = params.seed + index
    return child
