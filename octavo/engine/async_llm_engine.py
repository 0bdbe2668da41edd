"""AsyncLLMEngine: vLLM's asyncio engine interface (`from_engine_args`, `generate` per request,
`abort`, `check_health`, ...) over the AsyncEngine step loop.

Owns only the translation: a vLLM-style call (one prompt, its SamplingParams, a request id)
becomes one EngineRequest, tokenized off the event loop; the AsyncEngine thread batches every
request in flight, whichever coroutine sent it. Outputs come back as the params'
`output_kind` asks (vLLM's default: cumulative).

Must not: step the engine or keep state of a request beyond the ids of those in flight (the
AsyncEngine and the LLMEngine own the rest).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing

from transformers import PreTrainedTokenizerBase

from octavo.config import AsyncEngineArgs, EngineArgs, EngineConfig
from octavo.core.sampling_params import SamplingParams
from octavo.engine.async_engine import AsyncEngine, EngineDeadError, EngineRequest
from octavo.engine.inputs import PromptType
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.outputs import RequestOutput

__all__ = ["AsyncEngineArgs", "AsyncLLMEngine"]


class AsyncLLMEngine:
    def __init__(self, async_engine: AsyncEngine) -> None:
        """Over an AsyncEngine that is built (prefer `from_engine_args`); its loop starts on
        the first call made from a running event loop."""
        self.async_engine = async_engine
        # The ids of the requests being generated: a second request under one of them is
        # refused before it reaches the engine.
        self._request_ids: set[str] = set()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLMEngine:
        """Load the model (blocking, as vLLM's does) on the thread that will step it."""
        return cls(AsyncEngine.from_factory(lambda: LLMEngine.from_engine_args(engine_args)))

    # --- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request and yield its RequestOutputs until the last (`finished`): every
        step's cumulative output, or what `sampling_params.output_kind` asks for (DELTA: only
        what is new; FINAL_ONLY: the last only). An `abort(request_id)` ends it with a final
        output whose finish reason is "abort"; closing or cancelling the generator aborts it.

        Raises ValueError naming the parameter for a bad prompt, bad params or a request id
        already in flight (the other requests run on), EngineDeadError once the engine has
        stopped."""
        self._start()
        if request_id in self._request_ids:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        self._request_ids.add(request_id)
        try:
            # Tokenizing is the caller's work, kept off both the loop and the step thread.
            processor = self.async_engine.engine.input_processor
            keep_last = processor.prompt_limit(sampling_params)
            processed = await asyncio.to_thread(processor.process_prompt, prompt, True, keep_last)
            request = EngineRequest(
                request_id,
                processed,
                sampling_params,
                time.monotonic(),
                priority,
                sampling_params.output_kind,
            )
            async with aclosing(self.async_engine.generate([request])) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._request_ids.discard(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End these requests at the next step: each generator yields its final output (finish
        reason "abort") and stops; their blocks return to the pool. Unknown ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.async_engine.abort(request_ids)

    # --- the engine ---------------------------------------------------------------------------

    async def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.async_engine.engine.tokenizer

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.async_engine.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """Every effective setting (octavo's EngineConfig; vLLM has no single equivalent)."""
        return self.async_engine.engine.config

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (the LLM's)."""
        return self.async_engine.engine.default_sampling_params()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block no request holds; False if some are held."""
        return await self.async_engine.call(lambda engine: engine.reset_prefix_cache())

    @property
    def is_running(self) -> bool:
        return self.async_engine.is_running

    @property
    def errored(self) -> bool:
        """The engine has stopped (shut down, or broken by failing steps)."""
        return self.async_engine.dead_reason is not None or not self.async_engine.is_running

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        reason = self.async_engine.dead_reason or "the engine thread has ended"
        return EngineDeadError(f"The engine is not running: {reason}")

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine has stopped."""
        if self.errored:
            raise self.dead_error

    def shutdown(self) -> None:
        """Abort what is in flight (its generators end with "abort" outputs) and stop the
        engine thread. Idempotent."""
        self.async_engine.shutdown()

    def _start(self) -> None:
        # From a coroutine: outputs are delivered on the running loop.
        self.async_engine.start(asyncio.get_running_loop())
