"""vLLM's `vllm.outputs` path: what `generate` returns (octavo.engine.outputs)."""

from octavo.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
