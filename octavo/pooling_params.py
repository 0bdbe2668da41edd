"""vLLM's `vllm.pooling_params` path: a pooling request's parameters
(octavo.core.pooling_params)."""

from octavo.core.pooling_params import PoolingParams

__all__ = ["PoolingParams"]
