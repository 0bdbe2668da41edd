"""vLLM's `vllm.sampling_params` path: the per-request parameters (octavo.core.sampling_params)."""

from octavo.core.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
