"""The thinking markers of each `--reasoning-parser` name (vLLM's names): the one list of them.

The server splits a thinking model's output into thinking and answer by these texts
(entrypoints/server/reasoning_parsers.py); the engine holds output constraints back until the
end marker's token (structured_output/reasoning.py). Plain data.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"

# --reasoning-parser name -> (the text that opens the thinking, the text that ends it).
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": (THINK_START, THINK_END),
    "qwen3": (THINK_START, THINK_END),
}
