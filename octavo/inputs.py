"""vLLM's `vllm.inputs` path: the prompt forms `generate` takes (octavo.engine.inputs)."""

from octavo.engine.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
