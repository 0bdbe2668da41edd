"""`POST /v1/embeddings`: OpenAI's embeddings, with vLLM 0.32's extras, for a pooling model.

Owns the request -> engine requests mapping (one pooling request per input; `data[i]` is input
i's vector) and the response shape: floats, or with `encoding_format: "base64"` the vector's
float32 bytes in base64 (little-endian, as OpenAI's client decodes them; vLLM's `endianness`
"big" flips them). `dimensions` keeps a Matryoshka model's prefix (400 naming it otherwise);
`use_activation` (vLLM's) turns the L2 normalization on or off; `truncate_prompt_tokens` keeps
each input's last N tokens (-1: the last max_model_len). vLLM's fields octavo does not
implement are refused with a 400 naming them (protocol.EmbeddingRequest), as are the removed
`normalize` and chat-style `messages` inputs.

Must not: step the engine or wait on anything but the AsyncEngine stream; tokenization happens
here (before submitting) so the step loop never waits on it.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from octavo.core.pooling_params import PoolingParams
from octavo.engine.async_engine import EngineRequest
from octavo.entrypoints.server.errors import OpenAIError, bad_request, from_value_error
from octavo.entrypoints.server.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EmbeddingUsage,
)
from octavo.entrypoints.server.request_body import check_body_size, parse_body, read_body
from octavo.entrypoints.server.serving_common import (
    ServingContext,
    check_model,
    check_num_sequences,
    check_priority,
    engine_error_to_openai,
    new_request_id,
    prepare,
    run_unless_disconnected,
)

ENCODING_FORMATS = ("float", "base64")
# The request fields a ValueError from the engine's checks may name.
EMBEDDING_FIELDS = {"input", "dimensions", "use_activation", "truncate_prompt_tokens", "priority"}


class OpenAIServingEmbedding:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, raw_request: Request) -> Response:
        context = self.context
        body = await read_body(
            raw_request, context.max_request_body_bytes, context.body_read_timeout_s
        )
        run = await prepare(context, self._prepare, body, time.monotonic())
        response = await run_unless_disconnected(raw_request, run.collect())
        if response is None:
            return Response(status_code=499)
        return Response(response.model_dump_json(), media_type="application/json")

    async def create_from_body(self, body: bytes) -> EmbeddingResponse:
        """The response to a JSON body without an HTTP request (`octavo run-batch`); raises
        the OpenAIError the endpoint would answer with."""
        check_body_size(len(body), self.context.max_request_body_bytes)
        run = await prepare(self.context, self._prepare, body, time.monotonic())
        return await run.collect()

    def _prepare(self, body: bytes, arrival_time: float) -> _Run:
        """Everything before the engine runs, in a preparation thread: decode and check the
        body, resolve the pooling parameters, tokenize every input."""
        context = self.context
        _check_removed_fields(body)
        request = parse_body(body, EmbeddingRequest)
        check_model(context, request.model)
        check_priority(context, request.priority)
        if request.encoding_format not in ENCODING_FORMATS:
            raise bad_request(
                f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; got "
                f"{request.encoding_format!r} (vLLM's bytes formats are not supported).",
                "encoding_format",
            )
        inputs = _input_list(request.input)
        check_num_sequences(context, len(inputs), 1)
        processor = context.async_engine.engine.input_processor
        params = PoolingParams(dimensions=request.dimensions, use_activation=request.use_activation)
        try:
            params = processor.resolve_pooling_params(params)
        except ValueError as exc:
            raise from_value_error(exc, EMBEDDING_FIELDS, {}) from None
        keep_last = request.truncate_prompt_tokens
        if keep_last == -1:
            keep_last = context.max_model_len
        elif keep_last == 0:
            raise bad_request(
                "truncate_prompt_tokens must be -1 or at least 1.", "truncate_prompt_tokens"
            )
        request_id = new_request_id("embd")
        engine_requests = []
        for index, item in enumerate(inputs):
            try:
                processed = processor.process_prompt(item, request.add_special_tokens, keep_last)
            except ValueError as exc:
                raise bad_request(str(exc), "input") from None
            engine_requests.append(
                EngineRequest(
                    f"{request_id}-{index}", processed, params, arrival_time, request.priority
                )
            )
        return _Run(context, request, request_id, engine_requests)


def _check_removed_fields(body: bytes) -> None:
    """vLLM's 400s for what its embeddings request no longer or not here takes."""
    try:
        data = json.loads(body)
    except ValueError:
        return  # parse_body says what is wrong
    if not isinstance(data, dict):
        return
    if "normalize" in data:
        raise bad_request(
            "Parameter `normalize` was removed; use `use_activation` instead.", "normalize"
        )
    if data.get("messages") is not None:
        raise bad_request(
            "Chat-style embeddings (messages) are not supported: give `input`.", "messages"
        )
    if data.get("task") not in (None, "embed"):
        raise bad_request(f"task={data['task']!r} is not supported here.", "task")


def _input_list(value: Any) -> list[str | list[int]]:
    """`input` as a list of texts or token-id lists; 400 naming `input` for anything else."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty.", "input")
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request(
            "input must be a non-empty string, list of strings, list of token ids or list of "
            "lists of token ids.",
            "input",
        )
    if all(_is_token_id(t) for t in value):
        return [value]
    if all(isinstance(t, str) for t in value):
        if not all(value):
            raise bad_request("input must not hold an empty string.", "input")
        return list(value)
    if all(isinstance(t, list) and t and all(_is_token_id(i) for i in t) for t in value):
        return list(value)
    if any(isinstance(t, dict) for t in value):
        raise bad_request(
            "Chat-style embeddings (messages in input) are not supported: give texts or token ids.",
            "input",
        )
    raise bad_request(
        "input must be a string, a list of strings, a list of token ids or a list of "
        "non-empty lists of token ids (one kind throughout).",
        "input",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encode_embedding(embedding: Sequence[float], encoding_format: str, endianness: str) -> Any:
    """The floats as they are, or their float32 bytes in base64 (little-endian unless
    `endianness` is "big")."""
    if encoding_format == "float":
        return list(embedding)
    dtype = ">f4" if endianness == "big" else "<f4"
    return base64.b64encode(np.asarray(embedding, dtype=dtype).tobytes()).decode("ascii")


class _Run:
    """One HTTP request's pooling requests, turned into one response."""

    def __init__(
        self,
        context: ServingContext,
        request: EmbeddingRequest,
        request_id: str,
        engine_requests: list[EngineRequest],
    ) -> None:
        self.context = context
        self.request = request
        self.request_id = request_id
        self.engine_requests = engine_requests

    async def collect(self) -> EmbeddingResponse:
        index_of = {r.request_id: i for i, r in enumerate(self.engine_requests)}
        vectors: list[list[float] | None] = [None] * len(self.engine_requests)
        engine = self.context.async_engine
        try:
            async with aclosing(engine.generate(self.engine_requests)) as outputs:
                async for output in outputs:
                    if output.finished:
                        vectors[index_of[output.request_id]] = output.outputs.data
        except OpenAIError:
            raise
        except Exception as exc:
            raise engine_error_to_openai(exc) from None
        if any(v is None or not v for v in vectors):
            raise OpenAIError(500, "The engine ended a request without its embedding.")
        request = self.request
        num_prompt_tokens = sum(len(r.prompt.prompt_token_ids) for r in self.engine_requests)
        return EmbeddingResponse(
            id=self.request_id,
            model=self.context.model_name,
            data=[
                EmbeddingResponseData(
                    index=i,
                    embedding=encode_embedding(v, request.encoding_format, request.endianness),
                )
                for i, v in enumerate(vectors)
                if v is not None
            ],
            usage=EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
        )
