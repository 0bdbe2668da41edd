"""vLLM's `vllm.beam_search` path: what `LLM.beam_search` returns (octavo.engine.beam_search)."""

from octavo.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchSequence,
    create_sort_beams_key_function,
    get_beam_search_score,
)

__all__ = [
    "BeamSearchOutput",
    "BeamSearchSequence",
    "create_sort_beams_key_function",
    "get_beam_search_score",
]
