"""The messages between the API server process and the engine-core process, in msgpack.

Each message is one msgpack array whose first item names it:

    frontend -> core    ["add", [request, ...]]
                        ["abort", [request_id, ...], stopped]
                        ["utility", call_id, method, [arg, ...]]
                        ["shutdown"]
    core -> frontend    ["step", [output, ...], iteration_stats, scheduler_stats]
                        ["utility", call_id, ok, result or error text]
                        ["failed", why]      (a step raised: the core has aborted everything)

Requests, outputs and stats are plain dataclasses of octavo.core and octavo.metrics; they
travel as arrays in field order (outputs) or maps by field name (parameters, stats), and come
back as the same dataclasses. Plain Python and msgpack only: no torch, no pickle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from octavo.core.outputs import EngineCoreOutput, TokenLogprobs
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import FinishReason, ResolvedParams
from octavo.core.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.engine.core import EngineCoreRequest
from octavo.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    # Logit-bias maps are keyed by token id (ints).
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# --- requests ---------------------------------------------------------------------------------


def encode_request(request: EngineCoreRequest) -> list[Any]:
    params = dataclasses.asdict(request.sampling_params)
    return [
        request.request_id,
        request.prompt_token_ids,
        params,
        request.resolved.max_tokens,
        sorted(request.resolved.stop_token_ids),
        request.arrival_time,
        request.priority,
        None if request.pooling_params is None else dataclasses.asdict(request.pooling_params),
    ]


def decode_request(item: list[Any]) -> EngineCoreRequest:
    (
        request_id,
        prompt_token_ids,
        params,
        max_tokens,
        stop_token_ids,
        arrival_time,
        priority,
        pooling,
    ) = item
    structured = params.pop("structured_outputs")
    if structured is not None:
        params["structured_outputs"] = StructuredOutputsParams(**structured)
    return EngineCoreRequest(
        request_id,
        prompt_token_ids,
        SamplingParams(**params),
        ResolvedParams(max_tokens, frozenset(stop_token_ids)),
        arrival_time,
        priority,
        None if pooling is None else PoolingParams(**pooling),
    )


# --- outputs ----------------------------------------------------------------------------------


def _encode_logprobs(positions: list[TokenLogprobs] | None) -> list[Any] | None:
    if positions is None:
        return None
    return [[lp.token_ids, lp.logprobs, lp.sampled_rank] for lp in positions]


def _decode_logprobs(items: list[Any] | None) -> list[TokenLogprobs] | None:
    return None if items is None else [TokenLogprobs(*lp) for lp in items]


def encode_output(output: EngineCoreOutput) -> list[Any]:
    return [
        output.request_id,
        output.new_token_ids,
        _encode_logprobs(output.new_logprobs),
        None if output.finish_reason is None else output.finish_reason.value,
        output.stop_reason,
        output.error,
        output.num_cached_tokens,
        _encode_logprobs(output.prompt_logprobs),
        output.pooled,
    ]


def decode_output(item: list[Any]) -> EngineCoreOutput:
    (
        request_id,
        token_ids,
        logprobs,
        finish_reason,
        stop_reason,
        error,
        num_cached,
        prompt,
        pooled,
    ) = item
    return EngineCoreOutput(
        request_id,
        token_ids,
        _decode_logprobs(logprobs),
        None if finish_reason is None else FinishReason(finish_reason),
        stop_reason,
        error,
        num_cached,
        _decode_logprobs(prompt),
        pooled,
    )


# --- stats ------------------------------------------------------------------------------------


def encode_iteration_stats(stats: IterationStats) -> dict[str, Any]:
    encoded = {
        field.name: getattr(stats, field.name)
        for field in dataclasses.fields(stats)
        if field.name != "finished_requests"
    }
    encoded["finished_requests"] = [
        {**dataclasses.asdict(finished), "finish_reason": finished.finish_reason.value}
        for finished in stats.finished_requests
    ]
    return encoded


def decode_iteration_stats(encoded: dict[str, Any]) -> IterationStats:
    finished = [
        FinishedRequestStats(
            **{
                **item,
                "finish_reason": FinishReason(item["finish_reason"]),
                "eviction_freezes_s": tuple(item["eviction_freezes_s"]),
            }
        )
        for item in encoded.pop("finished_requests")
    ]
    return IterationStats(**encoded, finished_requests=finished)


def encode_scheduler_stats(stats: SchedulerStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def decode_scheduler_stats(encoded: dict[str, Any]) -> SchedulerStats:
    spec = encoded.get("spec_decoding")
    if spec is not None:
        per_pos = tuple(spec.pop("num_accepted_tokens_per_pos"))
        encoded = {
            **encoded,
            "spec_decoding": SpecDecodingStats(**spec, num_accepted_tokens_per_pos=per_pos),
        }
    return SchedulerStats(**encoded)
