"""LLMEngine: add_request / step / abort over the input processor, an in-process EngineCore
(scheduler, runner, grammars) and the output processor. `step()` is the one data flow of the
engine:

    schedule -> grammar bitmask -> execute -> update -> process_outputs

The bitmask holds the allowed tokens of this step's sampling structured-output requests; their
grammars are compiled off the step loop by the StructuredOutputManager.

The engine owns no policy of its own: admission lives in the scheduler, tensors in the runner,
text in the output processor. It fans `n > 1` out into child requests (`fan_out`), which the
scheduler sees as independent streams sharing the prompt's cached blocks. The frontend of the
engine-core process (octavo/engine/core_client.py) does the same on its side of the boundary.

Each step hands the step's SchedulerStats and IterationStats (timed by the core's
RequestStatsTracker) to its stat loggers (Prometheus, request log).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from octavo.config import EngineArgs, EngineConfig, capacity_line, weights_line
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import ResolvedParams
from octavo.core.sampling_params import RequestOutputKind, SamplingParams
from octavo.engine.core import EngineCore, EngineCoreRequest, check_sleep
from octavo.engine.input_processor import (
    InputProcessor,
    PoolingSupport,
    ProcessedPrompt,
    PromptType,
)
from octavo.engine.output_processor import OutputKind, OutputProcessor, ProcessedOutputs
from octavo.engine.outputs import PoolingRequestOutput, RequestOutput
from octavo.metrics.request_log import RequestLogWriter
from octavo.metrics.spec_decode_log import SpecDecodingLogger
from octavo.metrics.stats import IterationStats, SchedulerStats, StatLogger
from octavo.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    # Engine cores behind this frontend (MPEngine's: data_parallel_size).
    num_replicas = 1

    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = EngineCore(config, model_runner, tokenizer, eos_token_ids)
        self.input_processor = InputProcessor(
            tokenizer,
            config.scheduler.max_model_len,
            model_runner.vocab_size,
            eos_token_ids,
            self.core.structured_output,
            config.max_logprobs,
            config.scheduler.scheduling_policy,
            pooling_support(config),
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._request_counter = itertools.count()
        self.stat_loggers: list[StatLogger] = []
        if config.request_log is not None:
            self.stat_loggers.append(RequestLogWriter(config.request_log))
        if config.speculative is not None:
            self.stat_loggers.append(SpecDecodingLogger())

    # The core's parts, for callers (benchmarks, tests) that look inside the engine.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def model_runner(self) -> ModelRunner:
        return self.core.model_runner

    @property
    def structured_output(self):
        return self.core.structured_output

    @property
    def stats_tracker(self):
        return self.core.stats_tracker

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Resolve `args` against this machine and model, build the worker, log the resolved
        configuration (the backend's choices included) as one JSON document and the KV
        capacity line, and return the engine."""
        if args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: an engine in this process is "
                "one engine; `octavo serve --data-parallel-size N` runs N engine-core "
                "processes behind one server."
            )
        config, runner, tokenizer, eos = build_core_parts(args)
        engine = cls(config, runner, tokenizer, eos)
        freeze_startup_objects()
        return engine

    # --- requests -----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the generation config's defaults applied (the model's
        generation_config.json unless --generation-config says otherwise, with
        --override-generation-config on top: config.sampling_defaults)."""
        return SamplingParams(**self.config.sampling_defaults)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        sampling_params: SamplingParams | PoolingParams,
        output_kind: OutputKind | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Check and queue one request. `output_kind`: what `step()` reports of it (None:
        `sampling_params.output_kind`, vLLM's rule: every step's cumulative output unless the
        params say otherwise). `priority` is vLLM's (lower runs earlier; anything but 0 needs
        the priority scheduling policy). PoolingParams (vLLM's add_request takes either) make
        it a pooling request, which a pooling engine runs and reports once, as a
        PoolingRequestOutput. Raises ValueError (naming the parameter) on bad input; nothing
        is queued then."""
        if isinstance(sampling_params, PoolingParams):
            request = pooling_request(
                self.input_processor,
                self.output_processor,
                request_id,
                prompt,
                sampling_params,
                arrival_time,
                priority,
            )
            self.core.add_request(request)
            return
        requests = fan_out(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            sampling_params,
            sampling_params.output_kind if output_kind is None else output_kind,
            arrival_time,
            priority,
        )
        # resolve_params compiled the grammar (if any): the core's add does not fail.
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests in any state; their blocks return to the pool at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort_requests(self.output_processor.abort_requests(request_ids))

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        step = self.core.step()
        processed = self.output_processor.process_outputs(step.outputs)
        # The one backward edge: stop strings found in the text end requests next step.
        self.core.abort_requests(processed.reqs_to_abort, stopped=True)
        iteration_stats = self.core.take_iteration_stats(step.num_scheduled_tokens)
        self._record_stats(add_finished_requests(iteration_stats, processed))
        return processed.request_outputs

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Hand every later step's stats to `stat_logger` (on the thread that steps)."""
        self.stat_loggers.append(stat_logger)

    def _record_stats(self, iteration_stats: IterationStats) -> None:
        if self.stat_loggers:
            record_stats(self.stat_loggers, self.core.make_stats(), iteration_stats)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    # --- sleep mode and the profiler (EngineCore's, with the frontend's part) ----------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Abort every request in flight (each caller gets its final output, finish reason
        "abort", from the next step), then put the core to sleep (EngineCore.sleep). Steps
        while asleep only deliver those outputs. ValueError naming a bad argument."""
        check_sleep(level, mode, self.config.enable_sleep_mode)
        self.abort_request(self.output_processor.unfinished_request_ids())
        self.core.sleep(level, mode)
        # The loggers see the sleep now, not at a next step that may be long in coming.
        self._record_stats(self.core.take_iteration_stats())

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)
        self._record_stats(self.core.take_iteration_stats())

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def start_profile(self) -> None:
        self.core.start_profile()

    def stop_profile(self) -> None:
        self.core.stop_profile()

    def make_stats(self) -> SchedulerStats:
        return self.core.make_stats()

    def kv_snapshots(self) -> list[dict[str, Any]]:
        """Each engine core's KV snapshot (EngineCore.kv_snapshot): this one's."""
        return [self.core.kv_snapshot()]

    def check_integrity(self) -> None:
        self.core.check_integrity()


def record_stats(
    stat_loggers: list[StatLogger],
    scheduler_stats: SchedulerStats,
    iteration_stats: IterationStats,
    engine_index: int = 0,
) -> None:
    """Hand one step's stats (of engine `engine_index`) to every logger; one that raises is
    logged, never the step's problem."""
    for stat_logger in stat_loggers:
        try:
            stat_logger.record(scheduler_stats, iteration_stats, engine_index)
        except Exception:
            logger.exception("stat logger %r failed", stat_logger)


def add_finished_requests(
    iteration_stats: IterationStats, processed: ProcessedOutputs
) -> IterationStats:
    """The core's stats of a step plus what only the frontend knows: the callers' requests
    that finished (their n, their longest stream), as vLLM's frontend records them."""
    iteration_stats.n_params.extend(processed.n_params)
    iteration_stats.max_num_generation_tokens.extend(processed.max_num_generation_tokens)
    return iteration_stats


def freeze_startup_objects() -> None:
    """What start-up built (the libraries' objects, modules, tokenizer: ~300,000 for the
    embedded model) lives as long as the engine. Frozen, the collector's full passes no longer
    walk it: each took ~0.15 s on two cores, a pause in every stream, and 1-2% of a
    prompt-heavy run's CPU time."""
    gc.collect()
    gc.freeze()


def pooling_support(config: EngineConfig) -> PoolingSupport | None:
    """What a pooling engine's requests are checked against (None for a generation engine)."""
    if config.pooler is None:
        return None
    return PoolingSupport(config.pooler, config.served_model_name)


def pooling_request(
    input_processor: InputProcessor,
    output_processor: OutputProcessor,
    request_id: str,
    prompt: PromptType | ProcessedPrompt,
    pooling_params: PoolingParams,
    arrival_time: float | None,
    priority: int = 0,
) -> EngineCoreRequest:
    """Check one pooling request, register it with `output_processor`, and return what the
    core runs of it. Its SamplingParams only carry what every request has (one output,
    reported once at the end); it takes no decode step and no KV beyond its prompt. Raises
    ValueError (naming the parameter) on bad input; nothing is registered then."""
    if output_processor.has_request(request_id):
        raise ValueError(f"request_id {request_id!r} is already in use.")
    params = input_processor.resolve_pooling_params(pooling_params)
    input_processor.check_priority(priority)
    if not isinstance(prompt, ProcessedPrompt):
        prompt = input_processor.process_prompt(prompt)
    carrier = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    output_processor.add_request(
        request_id,
        prompt.prompt,
        prompt.prompt_token_ids,
        carrier,
        OutputKind.FINAL_ONLY,
        is_pooling=True,
    )
    return EngineCoreRequest(
        request_id,
        prompt.prompt_token_ids,
        carrier,
        ResolvedParams(max_tokens=0, stop_token_ids=frozenset()),
        time.monotonic() if arrival_time is None else arrival_time,
        priority,
        params,
    )


def fan_out(
    input_processor: InputProcessor,
    output_processor: OutputProcessor,
    request_id: str,
    prompt: PromptType | ProcessedPrompt,
    sampling_params: SamplingParams,
    output_kind: OutputKind,
    arrival_time: float | None,
    priority: int = 0,
) -> list[EngineCoreRequest]:
    """Check one request, register it with `output_processor`, and return what the core runs
    of it: itself, or its n children (each with its priority). Raises ValueError (naming the
    parameter) on bad input; nothing is registered then."""
    if output_processor.has_request(request_id):
        raise ValueError(f"request_id {request_id!r} is already in use.")
    input_processor.check_generation("Generation (a SamplingParams request)")
    input_processor.check_priority(priority)
    if isinstance(prompt, ProcessedPrompt):
        processed = input_processor.truncate(prompt, sampling_params)
    else:
        keep_last = input_processor.prompt_limit(sampling_params)
        processed = input_processor.process_prompt(prompt, keep_last=keep_last)
    params = sampling_params.clone()
    resolved = input_processor.resolve_params(params, len(processed.prompt_token_ids))
    params.bad_words_token_ids = (
        input_processor.tokenize_bad_words(params.bad_words) if params.bad_words else None
    )
    arrival_time = time.monotonic() if arrival_time is None else arrival_time
    if params.n == 1:
        children = [(request_id, params)]
        child_ids = None
    else:
        children = [(f"{i}_{request_id}", _child_params(params, i)) for i in range(params.n)]
        child_ids = [child_id for child_id, _ in children]
    output_processor.add_request(
        request_id, processed.prompt, processed.prompt_token_ids, params, output_kind, child_ids
    )
    return [
        EngineCoreRequest(
            child_id, processed.prompt_token_ids, child_params, resolved, arrival_time, priority
        )
        for child_id, child_params in children
    ]


def build_core_parts(
    args: EngineArgs,
) -> tuple[EngineConfig, ModelRunner, PreTrainedTokenizerBase, tuple[int, ...]]:
    """Resolve `args` against this machine and model, build the worker, log the resolved
    configuration (the backend's choices included) as one JSON document and the KV capacity
    line; return the configuration, the runner, the tokenizer and the EOS ids."""
    # Imported here so that `octavo.engine` stays importable without loading a model.
    from octavo.engine.tokenizer import load_tokenizer
    from octavo.worker.setup import build_model_runner, probe

    facts = probe(args)
    config = args.create_engine_config(
        facts.platform,
        facts.model_config,
        facts.model_path,
        facts.weight_bytes,
        tokenizer_path=facts.tokenizer_path,
        generation_defaults=facts.generation_defaults,
        hf_config_path=facts.hf_config_path,
        st_pooling=facts.st_pooling,
        draft_model_path=facts.draft_model_path,
        draft_model_config=facts.draft_model_config,
    )
    runner, backend, config = build_model_runner(config)
    config = dataclasses.replace(config, backend_choices=backend.describe())
    logger.info("dtype %s (%s)", config.dtype, config.dtype_reason)
    logger.info("resolved configuration: %s", config.to_json())
    logger.info(weights_line(backend.weights_report.get("bytes_by_type", {})))
    if "draft_model" in backend.weights_report:
        draft = backend.weights_report["draft_model"]
        logger.info("draft model %s: %s", draft["path"], weights_line(draft["bytes_by_type"]))
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
    tokenizer = load_tokenizer(config.tokenizer_path, config.chat_template)
    eos = model_config.eos_token_ids or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return config, runner, tokenizer, tuple(eos)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    child = params.clone()
    child.n = 1
    # A seeded parent gives each child its own stream (vLLM: seed + index).
    if params.seed is not None:
        child.seed = params.seed + index
    return child
