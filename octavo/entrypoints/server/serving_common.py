"""What the completion and chat handlers share: request parsing, OpenAI fields -> SamplingParams,
prompt tokenization off the step loop, SSE framing, usage, and disconnect handling.

Owns `ServingContext` (the engine handle and the model facts handlers need) and the helpers.
Must not: call into LLMEngine from the event loop except its thread-safe, read-only input
processor and tokenizer (the AsyncEngine thread alone steps the engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from octavo.core.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.outputs import RequestOutput
from octavo.entrypoints.server.errors import (
    OpenAIError,
    bad_request,
    error_body,
    from_validation_error,
    from_value_error,
)
from octavo.entrypoints.server.protocol import PromptTokensDetails, UsageInfo

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)

# vLLM's default cap on logprobs per position.
MAX_LOGPROBS = 20
# More samples per prompt than this is a mistake or an attack, not a use.
MAX_N = 128
# Prompts longer than this (in characters) are tokenized in a worker thread so a big request
# does not hold the event loop while others stream.
_TOKENIZE_INLINE_CHARS = 4096
# OpenAI seeds are 64-bit; torch accepts signed or unsigned 64-bit values.
_SEED_RANGE = (-(2**63), 2**64 - 1)
# logprob -inf has no JSON form; vLLM clamps to this.
_MIN_LOGPROB = -9999.0

# The parameters a SamplingParams error may name: its fields (the request fields of the same
# name), and the prompt.
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages"}
# SamplingParams fields the handler derives itself from the request (renamed by the endpoint,
# clipped, parsed or checked against the model); every other one is copied by name.
_DERIVED_FIELDS = {"max_tokens", "logprobs", "logit_bias", "top_k", "structured_outputs"}


@dataclass(frozen=True)
class ServingContext:
    async_engine: AsyncEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    max_request_body_bytes: int


def check_model(context: ServingContext, model: str | None) -> None:
    if model is not None and model != context.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


async def parse_body(request: Request, model_type: type[ModelT], limit_bytes: int) -> ModelT:
    """Read at most `limit_bytes` of JSON and validate it; 413 above the limit, 400 on bad
    JSON or types (never FastAPI's 422 dump)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise _too_large(limit_bytes)
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _too_large(limit_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body exceeds the limit of {limit_bytes} bytes.",
        None,
        "request_too_large",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def make_sampling_params(
    context: ServingContext,
    request: Any,
    max_tokens: int | None,
    logprobs: int | None,
    rename: dict[str, str],
) -> SamplingParams:
    """OpenAI fields -> SamplingParams; ValueError becomes a 400 naming the user's field."""
    if request.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {request.n}.", "n")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        param = rename.get("logprobs", "logprobs")
        raise bad_request(f"{param} must be at most {MAX_LOGPROBS}, got {logprobs}.", param)
    if request.seed is not None and not _SEED_RANGE[0] <= request.seed <= _SEED_RANGE[1]:
        raise bad_request(f"seed must be a 64-bit integer, got {request.seed}.", "seed")
    if max_tokens is not None and max_tokens > context.max_model_len:
        param = rename.get("max_tokens", "max_tokens")
        raise bad_request(
            f"{param}={max_tokens} exceeds max_model_len={context.max_model_len}.", param
        )
    top_k = request.top_k
    if top_k is not None and top_k > context.vocab_size:
        top_k = 0  # keeping more tokens than the vocabulary has is no filter at all
    logit_bias = None
    if request.logit_bias is not None:
        try:
            logit_bias = {int(token): bias for token, bias in request.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids.", "logit_bias") from None
    # Every SamplingParams field the request has under the same name; an unset (None) one keeps
    # SamplingParams' default (vLLM's).
    fields: dict[str, Any] = {
        name: value
        for name in _copied_fields(type(request))
        if (value := getattr(request, name)) is not None
    }
    fields.update(
        max_tokens=max_tokens,
        logprobs=logprobs,
        logit_bias=logit_bias,
        structured_outputs=structured_outputs_params(context, request),
    )
    if top_k is not None:
        fields["top_k"] = top_k
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise from_value_error(exc, SAMPLING_FIELDS, rename) from None


@functools.cache
def _copied_fields(request_type: type) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in dataclasses.fields(SamplingParams)
        if f.name in request_type.model_fields and f.name not in _DERIVED_FIELDS
    )


def structured_outputs_params(
    context: ServingContext, request: Any
) -> StructuredOutputsParams | None:
    """`response_format` (chat) or vLLM's `structured_outputs` -> StructuredOutputsParams,
    checked now (a bad schema, regex or grammar is a 400 naming the field the user set)."""
    response_format = getattr(request, "response_format", None)
    requested = request.structured_outputs
    if response_format is not None and response_format.type != "text":
        if requested is not None:
            raise bad_request(
                "response_format and structured_outputs cannot both be set.", "response_format"
            )
        param = "response_format"
        if response_format.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise bad_request(
                "response_format.json_schema.schema is required when type is 'json_schema'.",
                param,
            )
        else:
            params = StructuredOutputsParams(json=response_format.json_schema.schema_)
    elif requested is not None:
        param = "structured_outputs"
        try:
            params = StructuredOutputsParams(
                json=requested.json_,
                regex=requested.regex,
                choice=requested.choice,
                grammar=requested.grammar,
                json_object=requested.json_object,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param) from None
    else:
        return None
    manager = context.async_engine.engine.input_processor.structured_output
    if manager is None:
        raise bad_request(f"{param} is not supported by this server.", param)
    try:
        manager.validate(params)
    except ValueError as exc:
        message = str(exc)
        if param == "response_format":
            message = message.replace("structured_outputs.json_object", "response_format")
            message = message.replace("structured_outputs.json", "response_format.json_schema")
        raise bad_request(message, param) from None
    return params


async def process_prompt(
    context: ServingContext,
    make: Callable[[], ProcessedPrompt],
    size_chars: int,
    params: SamplingParams,
    rename: dict[str, str],
) -> ProcessedPrompt:
    """Tokenize (inline if small, else in a worker thread) and check the prompt and its
    max_tokens against max_model_len, so the engine never rejects what gets submitted."""
    try:
        if size_chars > _TOKENIZE_INLINE_CHARS:
            processed = await asyncio.to_thread(make)
        else:
            processed = make()
        processor = context.async_engine.engine.input_processor
        processor.resolve_params(params, len(processed.prompt_token_ids))  # checks only
    except ValueError as exc:
        raise from_value_error(exc, SAMPLING_FIELDS, rename) from None
    return processed


def engine_error_to_openai(exc: Exception) -> OpenAIError:
    """What a failure while running requests means for the client."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return from_value_error(exc, SAMPLING_FIELDS, {})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc))
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc))
    return OpenAIError(500, f"Internal server error: {exc!r}")


def engine_error_body(exc: Exception) -> dict[str, Any]:
    """The error object a stream sends as its last event before [DONE]."""
    error = engine_error_to_openai(exc)
    return error_body(error.status_code, error.message, error.param, error.code)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def decoded(token: str | None) -> str:
    return token if token is not None else ""


@dataclass(slots=True)
class PromptUsage:
    """Per prompt of one HTTP request: its length and the prefix-cache hits it reported."""

    num_prompt_tokens: int
    num_cached_tokens: int = 0

    def update(self, output: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (None then). Cancelling
    closes the engine stream inside `work`, which aborts its requests within one step."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # the handler itself was cancelled (shutdown): take the work with it
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone. The body was read already, so the next ASGI message
    is the disconnect (or the end of the response)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
