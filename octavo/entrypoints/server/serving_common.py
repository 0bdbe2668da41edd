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
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from octavo.config import DEFAULT_MAX_LOGPROBS
from octavo.core.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequestError,
    EngineStepError,
)
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.outputs import PromptLogprobs, RequestOutput
from octavo.engine.queue_limits import QueueOverflowError
from octavo.entrypoints.server.errors import (
    OpenAIError,
    bad_request,
    error_body,
    from_validation_error,
    from_value_error,
)
from octavo.entrypoints.server.protocol import (
    ChatCompletionRequest,
    PromptLogprob,
    PromptTokensDetails,
    UsageInfo,
)
from octavo.entrypoints.server.request_body import check_body_size, read_body

T = TypeVar("T")

# More samples per prompt than this is a mistake or an attack, not a use.
MAX_N = 128
# logprob -inf has no JSON form; vLLM clamps to this.
_MIN_LOGPROB = -9999.0

# The parameters a SamplingParams error may name: its fields (the request fields of the same
# name), and the prompt.
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages"}
# SamplingParams fields the handler derives itself from the request (renamed by the endpoint,
# clipped, parsed or checked against the model); every other one is copied by name.
_DERIVED_FIELDS = {"max_tokens", "logprobs", "logit_bias", "top_k", "structured_outputs"}

# Seconds a request shed by the queue bounds is told to wait before it retries (Retry-After):
# one second, about what the engine takes to finish a few steps of the requests ahead of it.
SHED_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServingContext:
    async_engine: AsyncEngine
    model_name: str  # the one responses report
    max_model_len: int
    vocab_size: int
    max_request_body_bytes: int
    # Where request bodies are decoded, checked, rendered and tokenized (see `prepare`).
    executor: Executor
    # Seconds the whole body may take to arrive.
    body_read_timeout_s: float = 30.0
    # Output streams (prompts x n) one request may ask for.
    max_sequences: int = 256
    # Every name a request may give in `model` (model_name's among them).
    model_names: tuple[str, ...] = ()
    # Most logprobs per position a request may ask for (--max-logprobs); -1: the vocabulary.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # The role of chat responses (--response-role), and whether every stream ends with a
    # usage chunk, asked for or not (--enable-force-include-usage).
    response_role: str = "assistant"
    force_include_usage: bool = False
    # Keyword arguments every chat template rendering gets under the request's own
    # (--default-chat-template-kwargs); whether logprobs name tokens `token_id:ID`
    # (--return-tokens-as-token-ids).
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    return_tokens_as_token_ids: bool = False
    # Whether a request may bring its own chat template (--trust-request-chat-template).
    trust_request_chat_template: bool = False
    # What a request that leaves a sampling field unset gets (EngineConfig.sampling_defaults),
    # and the max_tokens no request may exceed (EngineConfig.max_tokens_cap).
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None


def check_model(context: ServingContext, model: str | None) -> None:
    if model is not None and model != context.model_name and model not in context.model_names:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


async def prepare(context: ServingContext, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` in the server's preparation threads, off the event loop: decoding the
    body, checking it, rendering and tokenizing. Its OpenAIError reaches the caller as is."""
    return await asyncio.get_running_loop().run_in_executor(context.executor, fn, *args)


async def respond(
    context: ServingContext, raw_request: Request, prepare_run: Callable[[bytes, float], Any]
) -> Response:
    """What every generating endpoint does with a request: read its body on the event loop
    (size and time limits), `prepare_run(body, arrival_time)` in a preparation thread (a run
    with `.request.stream`, `.engine_requests`, `.stream()` and `.collect()`), then stream the
    run or return its whole response (499 when the client has gone before it is done)."""
    body = await read_body(raw_request, context.max_request_body_bytes, context.body_read_timeout_s)
    run = await prepare(context, prepare_run, body, time.monotonic())
    return await respond_run(context, raw_request, run)


async def respond_run(context: ServingContext, raw_request: Request, run: Any) -> Response:
    """The second half of `respond`, for a run already prepared: its stream (SSE) or its
    whole response as JSON."""
    if run.request.stream:
        # The queue bounds, before the 200 goes out: a rejected stream gets a 503, not an
        # error event (the run's own submission checks again).
        try:
            context.async_engine.check_admission(run.engine_requests)
        except QueueOverflowError as exc:
            raise engine_error_to_openai(exc) from None
        return StreamingResponse(run.stream(), media_type="text/event-stream")
    response = await run_unless_disconnected(raw_request, run.collect())
    if response is None:
        return Response(status_code=499)
    return Response(response.model_dump_json(), media_type="application/json")


async def collect_body(
    context: ServingContext, prepare_run: Callable[[bytes, float], Any], body: bytes
) -> BaseModel:
    """`respond` for a body already in hand and no client connection (`octavo run-batch`):
    the same size limit, preparation and run, the whole response returned; a failure raises
    the OpenAIError the server would answer with (any other exception is the server's 500).
    A stream has no place to go: 400."""
    check_body_size(len(body), context.max_request_body_bytes)
    run = await prepare(context, prepare_run, body, time.monotonic())
    if run.request.stream:
        raise bad_request("A batch request cannot stream: leave stream unset or false.", "stream")
    return await run.collect()


def check_priority(context: ServingContext, priority: int) -> None:
    """vLLM's `priority` extra: 400 naming it unless the server schedules by priority (or it
    is 0)."""
    try:
        context.async_engine.engine.input_processor.check_priority(priority)
    except ValueError as exc:
        raise bad_request(str(exc), "priority") from None


def check_num_sequences(context: ServingContext, num_prompts: int, n: int) -> None:
    """400 when one request asks for more output streams (prompts x n) than the limit."""
    if num_prompts * n > context.max_sequences:
        param = "n" if num_prompts == 1 else "prompt"
        raise bad_request(
            f"The request asks for {num_prompts * n} sequences ({num_prompts} prompts x n="
            f"{n}); at most {context.max_sequences} are allowed per request.",
            param,
        )


def generation_max_tokens(context: ServingContext, requested: int | None) -> int | None:
    """What the generation config makes of a request's max_tokens (vLLM's get_max_tokens):
    its default where the request sets none, the cap (--override-generation-config's
    max_new_tokens, or a --generation-config folder's) over either. Returns that limit where
    it decides, None where the request's own max_tokens (or none, the room the prompt leaves)
    stands. The limit is cut to what each prompt leaves of max_model_len (process_prompt)."""
    limits = [context.max_tokens_cap]
    if requested is None:
        limits.append(context.sampling_defaults.get("max_tokens"))
    limit = min((value for value in limits if value is not None), default=None)
    if limit is None or (requested is not None and requested <= limit):
        return None
    return limit


def make_sampling_params(
    context: ServingContext,
    request: Any,
    max_tokens: int | None,
    logprobs: int | None,
    rename: dict[str, str],
) -> SamplingParams:
    """OpenAI fields -> SamplingParams; ValueError becomes a 400 naming the user's field. A
    field the request leaves unset takes the generation config's default
    (context.sampling_defaults) where it has one, else SamplingParams' own; max_tokens is the
    caller's (see generation_max_tokens)."""
    if request.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {request.n}.", "n")
    cap = context.max_logprobs
    if logprobs is not None and 0 <= cap < logprobs:
        param = rename.get("logprobs", "logprobs")
        raise bad_request(f"{param} must be at most {cap} (--max-logprobs), got {logprobs}.", param)
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
    # Every SamplingParams field the request has under the same name; an unset (None) one takes
    # the generation config's default, else keeps SamplingParams' own (vLLM's rule).
    fields: dict[str, Any] = {
        name: value for name, value in context.sampling_defaults.items() if name != "max_tokens"
    }
    fields.update(
        (name, value)
        for name in _copied_fields(type(request))
        if (value := getattr(request, name)) is not None
    )
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


def process_prompt(
    context: ServingContext,
    make: Callable[[], ProcessedPrompt],
    params: SamplingParams,
    rename: dict[str, str],
    max_tokens_limit: int | None = None,
) -> tuple[ProcessedPrompt, SamplingParams]:
    """Tokenize (in the preparation thread that calls it) and check the prompt and its
    max_tokens against max_model_len, so the engine never rejects what gets submitted.
    Returns the prompt and its parameters: `params`, or, with a `max_tokens_limit` (from
    generation_max_tokens), a copy whose max_tokens is that limit cut to what the prompt
    leaves of max_model_len (the server's choice, never refused as a request's own is)."""
    try:
        processed = make()
        processor = context.async_engine.engine.input_processor
        num_prompt_tokens = len(processed.prompt_token_ids)
        if max_tokens_limit is not None:
            room = context.max_model_len - num_prompt_tokens
            params = dataclasses.replace(params, max_tokens=min(max_tokens_limit, room))
        processor.resolve_params(params, num_prompt_tokens)  # checks only
    except ValueError as exc:
        raise from_value_error(exc, SAMPLING_FIELDS, rename) from None
    return processed, params


def engine_error_to_openai(exc: Exception) -> OpenAIError:
    """What a failure while running requests means for the client."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return from_value_error(exc, SAMPLING_FIELDS, {})
    if isinstance(exc, QueueOverflowError):
        # Shed before admission: the client may come back (DESIGN.md's rule for shedding).
        retry_after_s = exc.retry_after_s or SHED_RETRY_AFTER_S
        return OpenAIError(503, str(exc), headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc))
    if isinstance(exc, (EngineStepError, EngineRequestError)):
        return OpenAIError(500, str(exc))
    return OpenAIError(500, f"Internal server error: {exc!r}")


def engine_error_body(exc: Exception) -> dict[str, Any]:
    """The error object a stream sends as its last event before [DONE]."""
    error = engine_error_to_openai(exc)
    return error_body(error.status_code, error.message, error.param, error.code)


def renamed(error: OpenAIError, names: Mapping[str, str]) -> OpenAIError:
    """`error` from the chat path, its parameter the field the client used (`names`: chat
    field -> client field), and so are the chat-only field names (those with an underscore,
    which plain words are not) in its message."""
    message = error.message
    for chat_name, own_name in names.items():
        if "_" in chat_name:
            message = re.sub(rf"\b{chat_name}\b", own_name, message)
    param = names.get(error.param or "", error.param)
    return OpenAIError(error.status_code, message, param, error.code, error.headers)


def chat_request_from(fields: dict[str, Any], names: Mapping[str, str]) -> ChatCompletionRequest:
    """A chat request from translated fields; a field the chat request refuses is a 400
    naming the client's field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(from_validation_error(exc), names) from None


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


def check_prompt_logprobs(request: Any) -> None:
    """vLLM's rule: prompt logprobs are not streamed (0 asks for none, so it may be)."""
    num = request.prompt_logprobs
    if request.stream and num is not None and (num > 0 or num == -1):
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """A RequestOutput's prompt_logprobs as the response's field: -inf clamped as every
    reported logprob is."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            token_id: PromptLogprob(
                logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def decoded(token: str | None) -> str:
    return token if token is not None else ""


def logprob_token(context: ServingContext, token_id: int, decoded_token: str | None) -> str:
    """How a logprobs entry names its token: its text, or `token_id:ID` (vLLM's spelling)
    under --return-tokens-as-token-ids, for clients that need the exact ids (a token whose
    bytes are not valid UTF-8 on their own has no faithful text)."""
    if context.return_tokens_as_token_ids:
        return f"token_id:{token_id}"
    return decoded(decoded_token)


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
