"""octavo: LLM inference and serving with a paged KV cache and continuous batching.

The names vLLM's package exports, where they mean something here, under vLLM's import paths
too (octavo.sampling_params, octavo.inputs, octavo.outputs, octavo.engine.arg_utils,
octavo.engine.async_llm_engine), so that vLLM code runs with `vllm` replaced by `octavo`.
"""

from octavo.config import AsyncEngineArgs, EngineArgs
from octavo.core.pooling_params import PoolingParams
from octavo.core.sampling_params import SamplingParams
from octavo.engine.inputs import PromptType, TextPrompt, TokensPrompt
from octavo.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # These pull in torch and the model code; import them only when asked for.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from octavo.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from octavo.engine.async_llm_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
