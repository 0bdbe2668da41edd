"""Architecture name (HF `architectures[0]`) -> model class, imported only when asked for.

Owns the list of what octavo can build. It must not load weights or read files; the loader asks
here and turns a miss into a ModelLoadError.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class). Mistral-style checkpoints are Llama with other names.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("octavo.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("octavo.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("octavo.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("octavo.model.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; raises ValueError naming it and the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"Architecture {architecture!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})."
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
