"""LLM: the offline API, with vLLM's names (`generate`, `chat`, `beam_search`, `embed`, `sleep` /
`wake_up`, `start_profile` / `stop_profile`, `get_metrics`), over one LLMEngine.

from octavo import LLM, SamplingParams
llm = LLM()                      # the embedded default model
llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
LLM(model=path, runner="pooling").embed(["Hello"])[0].outputs.embedding
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from octavo.config import EngineArgs
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import FinishReason
from octavo.core.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    check_beam_width,
    step_sampling_params,
)
from octavo.engine.input_processor import ProcessedPrompt, PromptType
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.output_processor import OutputKind
from octavo.engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from octavo.entrypoints.vllm_compat import check_keywords
from octavo.metrics.prometheus import PrometheusStatLogger, stat_logger_for
from octavo.metrics.reader import Metric, get_metrics_snapshot

logger = logging.getLogger(__name__)

Conversation = list[Mapping[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: an HF folder or .gguf file (None: the embedded default). Every other
        keyword is an EngineArgs field, with the meaning and default of the flag of the same
        name (octavo/config.py lists them: dtype, max_model_len, kv_cache_tokens, admission,
        chat_template, ...), or one of vLLM's EngineArgs fields, held to the disposition of its
        flag (vllm_compat.py: logged where it has no effect here, a ValueError naming it where
        it is refused); any other keyword is a TypeError."""
        own = {f.name for f in dataclasses.fields(EngineArgs)}
        vllm_only = {name: value for name, value in kwargs.items() if name not in own}
        for note in check_keywords(vllm_only):
            logger.info(note)
        settings = {name: value for name, value in kwargs.items() if name in own}
        self._start(LLMEngine.from_engine_args(EngineArgs(model=model, **settings)))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(LLMEngine.from_engine_args(args))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        # The engine's metrics, which get_metrics reads (a registry of this LLM's own).
        self._stat_logger: PrometheusStatLogger = stat_logger_for(engine.config)
        engine.add_stat_logger(self._stat_logger)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's method)."""
        return self.llm_engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (those no running request holds); False if some
        are still held."""
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's Prometheus metrics, those /metrics serves: one
        Counter, Gauge or Histogram (octavo.metrics.reader, vLLM's classes) per series of the
        `vllm:` and `octavo:` families, e.g. Counter("vllm:prompt_tokens", {...}, 12). Always
        recorded here; vLLM needs disable_log_stats=False for it."""
        return get_metrics_snapshot(self._stat_logger.registry)

    # --- sleep mode (vLLM's) ------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Release the engine's memory until wake_up (needs enable_sleep_mode=True). Level 1:
        the KV cache's contents are forgotten and its memory freed, the prefix cache reset; the
        weights stay, as vLLM keeps them in host memory: on a CPU they are there already (on
        another device octavo frees them and reloads them from the model files at wake-up).
        Level 2: the weights are freed too and reloaded from the model files at wake-up.
        Level 0: nothing is freed; the engine only stops stepping. `mode` "abort" (vLLM's
        default; its "wait" and "keep" are not implemented): requests still in flight end
        with finish reason "abort". generate() while asleep is a RuntimeError."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: `tags` among "weights", "kv_cache" and "scheduling"
        (None: all). The engine runs again once all three are awake; it then gives the same
        tokens as before it slept."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    # --- the profiler (vLLM's) ----------------------------------------------------------------

    def start_profile(self) -> None:
        """Start the torch profiler over the engine's steps (needs profiler_config, or the
        VLLM_TORCH_PROFILER_DIR environment variable, at start-up; else RuntimeError)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop it and write the trace (`*.pt.trace.json.gz`) to the configured folder."""
        self.llm_engine.stop_profile()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order. `prompts` may be a string, a
        list of token ids, a list of either, or vLLM's {"prompt_token_ids": [...]} dicts.
        `priority` (vLLM's): one integer per prompt, lower runs earlier; anything but 0 needs
        `scheduling_policy="priority"`."""
        self.llm_engine.input_processor.check_generation("LLM.generate()")
        return self._run(self._as_prompt_list(prompts), sampling_params, use_tqdm, priority)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding per prompt, in the prompts' order (a pooling model's: runner
        "pooling"). `pooling_params`: one for all or one per prompt (use_activation: L2-
        normalize; dimensions: a Matryoshka model's prefix); `truncate_prompt_tokens`: keep
        each prompt's last N tokens (-1: the last max_model_len). A ValueError naming the
        parameter rejects the whole call before anything runs."""
        engine = self.llm_engine
        processor = engine.input_processor
        prompt_list = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"pooling_params has {len(params_list)} entries for {len(prompt_list)} prompts."
                )
        for params in params_list:
            processor.resolve_pooling_params(params)  # checks only
        if truncate_prompt_tokens is not None and not (
            truncate_prompt_tokens == -1 or truncate_prompt_tokens >= 1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}."
            )
        keep_last = (
            engine.config.scheduler.max_model_len
            if truncate_prompt_tokens == -1
            else truncate_prompt_tokens
        )
        processed = [processor.process_prompt(p, keep_last=keep_last) for p in prompt_list]
        outputs = self._run_requests(processed, params_list, use_tqdm, priority)
        for output in outputs:
            if output.finish_reason is not None and output.finish_reason != "stop":
                raise RuntimeError(
                    f"request {output.request_id} ended with {output.finish_reason}: "
                    f"{output.error or 'no embedding'}"
                )
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (`chat_template`, else the model's
        or the engine's override), then generate. `tools` (OpenAI's tool dicts) are passed to
        the template, which renders them if it supports tools; the output is not parsed."""
        self.llm_engine.input_processor.check_generation("LLM.chat()")
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        processor = self.llm_engine.input_processor
        prompts = [
            processor.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt, its `sequences` the best
        params.beam_width beams, best first, each with `tokens` (the prompt's, then the beam's,
        EOS included), `text` (all of them decoded), `cum_logprob` and per-position
        `logprobs`. Each step runs every live beam of every prompt (of `concurrency_limit`
        prompts at a time; None: all) as a one-token request in one batch (see
        octavo/engine/beam_search.py). EOS is any of the engine's EOS tokens. `lora_request`
        is vLLM's; octavo has no LoRA, so anything but None is a ValueError."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported by octavo.")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}.")
        engine = self.llm_engine
        if engine.is_sleeping():
            raise RuntimeError("The engine is asleep: call wake_up() before generating.")
        processor = engine.input_processor
        check_beam_width(processor.max_logprobs, params.beam_width, "beam_width")
        processed = [processor.process_prompt(p) for p in self._as_prompt_list(prompts)]
        whole = SamplingParams(max_tokens=params.max_tokens)
        for prompt in processed:
            processor.resolve_params(whole, len(prompt.prompt_token_ids))  # checks only
        searches = [
            BeamSearch(p.prompt_token_ids, params, processor.eos_token_ids, p.prompt)
            for p in processed
        ]
        step_params = step_sampling_params(params)
        limit = concurrency_limit or max(len(searches), 1)
        for start in range(0, len(searches), limit):
            batch = searches[start : start + limit]
            steps = range(params.max_tokens)
            for _ in tqdm(steps, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True):
                if all(search.is_done() for search in batch):
                    break
                self._beam_search_step(batch, step_params)
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = engine.tokenizer.decode(
                    beam.tokens, skip_special_tokens=params.skip_special_tokens
                )
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _beam_search_step(self, searches: list[BeamSearch], step_params: SamplingParams) -> None:
        """Every live beam of `searches` as a one-token request, all in one batch."""
        engine = self.llm_engine
        owners: list[BeamSearch] = []
        request_ids: list[str] = []
        for search in searches:
            if search.is_done():
                continue
            for beam in search.beams:
                request_id = engine.next_request_id()
                prompt = ProcessedPrompt(None, beam.tokens)
                engine.add_request(request_id, prompt, step_params, OutputKind.FINAL_ONLY)
                owners.append(search)
                request_ids.append(request_id)
        results = self._run_engine(request_ids, use_tqdm=False)
        for search in dict.fromkeys(owners):
            mine = [r.outputs[0] for r, owner in zip(results, owners) if owner is search]
            if any(c.finish_reason in (FinishReason.ABORT, FinishReason.ERROR) for c in mine):
                search.abort()
            else:
                search.advance([(c.token_ids[0], c.logprobs[0]) for c in mine])

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run(
        self,
        prompts: list[PromptType | ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.llm_engine.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts."
                )
        engine = self.llm_engine
        processor = engine.input_processor
        # Check everything before queueing anything: one bad prompt rejects the whole call.
        processed = [
            processor.truncate(p, params)
            if isinstance(p, ProcessedPrompt)
            else processor.process_prompt(p, keep_last=processor.prompt_limit(params))
            for p, params in zip(prompts, params_list)
        ]
        for prompt, params in zip(processed, params_list):
            processor.resolve_params(params, len(prompt.prompt_token_ids))  # checks only
        return self._run_requests(processed, params_list, use_tqdm, priority)

    def _run_requests(
        self,
        processed: list[ProcessedPrompt],
        params_list: Sequence[SamplingParams] | Sequence[PoolingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None,
    ) -> list[Any]:
        """Queue checked prompts with their params (every one of them, or none: a ValueError
        names the parameter) and run the engine until they have all finished."""
        if self.llm_engine.is_sleeping():
            raise RuntimeError("The engine is asleep: call wake_up() before generating.")
        priorities = [0] * len(processed) if priority is None else list(priority)
        if len(priorities) != len(processed):
            raise ValueError(
                f"priority has {len(priorities)} entries for {len(processed)} prompts."
            )
        engine = self.llm_engine
        for value in priorities:
            engine.input_processor.check_priority(value)
        request_ids = []
        try:
            for prompt, params, value in zip(processed, params_list, priorities):
                request_id = engine.next_request_id()
                engine.add_request(
                    request_id, prompt, params, OutputKind.FINAL_ONLY, priority=value
                )
                request_ids.append(request_id)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool
    ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        start = time.perf_counter()
        num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    if isinstance(output, RequestOutput):
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output: {num_output_tokens / elapsed:.1f} tok/s")
                    bar.update(1)
        except BaseException:
            # Ctrl-C or an engine error: leave no request (and no block) behind.
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]
