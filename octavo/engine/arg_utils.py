"""vLLM's `vllm.engine.arg_utils` path: the engine's settings (octavo.config)."""

from octavo.config import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
