"""The operator's endpoints: GET /v1/kv (what the KV cache holds and who holds it) and GET
/v1/config (the resolved configuration, the JSON document the engine logs at start-up).

/v1/kv joins each engine core's snapshot (core/kv_view.py, read between two of its steps
through the engine's utility calls, in process or in the engine-core processes) with what
the frontend knows: the measured step rates (engine/step_rates.py) and the prompt tokens
submitted and not yet prefilled. `octavo top` draws it.

Must not: change the engine; both endpoints only read.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from octavo.engine.async_engine import AsyncEngine

# The pool's counts that add up over engines (data-parallel replicas).
_SUMMED = (
    "num_blocks",
    "num_free_blocks",
    "num_cached_blocks",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_preemptions",
    "num_evicted_cached_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


def add_ops_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    @app.get("/v1/kv")
    async def kv() -> JSONResponse:
        snapshots = await async_engine.call(lambda e: e.kv_snapshots())
        return JSONResponse(kv_document(snapshots, async_engine))

    @app.get("/v1/config")
    async def config() -> Response:
        # The very document logged at start-up (EngineConfig.to_json).
        return Response(async_engine.engine.config.to_json(), media_type="application/json")


def kv_document(snapshots: list[dict[str, Any]], async_engine: AsyncEngine) -> dict[str, Any]:
    """GET /v1/kv's body: the engines' pools summed (`engines` keeps each one's), every
    request with its engine's index, the step rates and the frontend's queue."""
    engines = []
    requests = []
    for index, snapshot in enumerate(snapshots):
        engine_index = snapshot.get("engine", index)
        requests.extend({**r, "engine": engine_index} for r in snapshot["requests"])
        engines.append(
            {k: v for k, v in snapshot.items() if k not in ("requests", "engine")}
            | {"engine": engine_index}
        )
    document: dict[str, Any] = {name: sum(e[name] for e in engines) for name in _SUMMED}
    num_blocks = document["num_blocks"]
    document["usage"] = 1.0 - document["num_free_blocks"] / num_blocks if num_blocks else 0.0
    document["block_size"] = engines[0]["block_size"] if engines else 0
    levels = [e["sleep_level"] for e in engines if e.get("sleep_level") is not None]
    document["sleep_level"] = max(levels, default=None)
    rates = async_engine.step_rates
    limits = async_engine.queue_limits
    document["rates"] = {
        "tokens_per_s": rates.tokens_per_s,
        "generation_tokens_per_s": rates.generation_tokens_per_s,
        "decode_step_s": rates.decode_step_s,
        "prompt_token_s": rates.prompt_token_s,
    }
    document["queue"] = {
        "num_requests": limits.num_reqs,
        "num_prompt_tokens": limits.num_prefill_tokens,
        # A one-token prompt's, submitted now (None before the rates are measured).
        "predicted_ttft_s": limits.predict_ttft_s(1),
        "max_queue_wait_s": limits.max_queue_wait_s,
    }
    document["engines"] = engines
    document["requests"] = requests
    return document
