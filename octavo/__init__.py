"""octavo: LLM inference and serving with a paged KV cache and continuous batching."""

from octavo.core.sampling_params import SamplingParams
from octavo.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
