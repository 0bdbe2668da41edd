"""The untrusted request body, from bytes on the socket to a validated protocol model.

Two halves, so that no request can hold the event loop: `read_body` (on the event loop) only
gathers the bytes, within the size limit and the read timeout, and turns a client that left
mid-body into ClientDisconnected instead of a traceback; `parse_body` (in a worker thread)
decodes the JSON and refuses, as a 400 naming the field, what would otherwise fail later with a
500: nesting deeper than MAX_JSON_DEPTH (checked while parsing, before any validator or schema
checker recurses into it) and strings that are not Unicode text (unpaired UTF-16 surrogates,
which the JSON escape \\ud800 can smuggle in and tokenizers reject).

Must not: know which endpoint a body is for beyond the model type it is validated into.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from octavo.entrypoints.server.errors import (
    ClientDisconnected,
    OpenAIError,
    bad_request,
    from_validation_error,
)

ModelT = TypeVar("ModelT", bound=BaseModel)

# JSON nesting a request may use; OpenAI bodies need about six (a tool schema a few more).
MAX_JSON_DEPTH = 64
# How much JSON a body may hold, counted before decoding it: json.loads holds the GIL for the
# whole body, and per byte some JSON costs far more than other (a 4 MB body of empty arrays,
# 1M of them, took 461 ms; 1M floats 205 ms; 1M object keys 717 ms: the event loop and every
# stream wait that long). The count is commas (values) plus JSON_STRUCTURE_COST per '[', '{'
# and ':' (arrays, objects, keys), characters inside strings included (an overcount, never an
# under-count). At the bound decoding takes ~65 ms at worst (520k floats: 129 ms); it leaves
# room for token-id prompts of 260k tokens in all, or a chat of 15k messages.
MAX_JSON_COST = 1 << 18
JSON_STRUCTURE_COST = 4


async def read_body(request: Request, limit_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes: 413 above `limit_bytes` (by the declared length, before reading, or
    as they arrive), 408 when the whole body takes longer than `timeout_s`; raises
    ClientDisconnected when the client goes away mid-body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit_bytes:
                    raise _too_large(limit_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(
            408, f"The request body did not arrive within {timeout_s:g} s.", None, "timeout"
        ) from None
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return b"".join(chunks)


def check_body_size(size: int, limit_bytes: int) -> None:
    """413 for a body of `size` bytes above `limit_bytes` (a body already in hand)."""
    if size > limit_bytes:
        raise _too_large(limit_bytes)


def parse_body(body: bytes, model_type: type[ModelT]) -> ModelT:
    """Decode and validate a JSON object body (in a worker thread: for a large body this is
    real work). 400 for what is not JSON, nests too deep, holds a string that is not text, or
    does not fit the model (never FastAPI's 422 dump); 413 for more JSON than MAX_JSON_COST
    allows."""
    check_json_cost(body)
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    check_json_tree(data)
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def check_json_cost(body: bytes) -> None:
    """413 if decoding `body` could cost more than MAX_JSON_COST (see above); a few
    milliseconds for the largest body."""
    structures = body.count(b"[") + body.count(b"{") + body.count(b":")
    cost = body.count(b",") + JSON_STRUCTURE_COST * structures
    if cost > MAX_JSON_COST:
        raise OpenAIError(
            413,
            f"The request body holds too much JSON to decode: ~{cost} values and structures "
            f"(commas, plus {JSON_STRUCTURE_COST} per array, object and key), more than the "
            f"{MAX_JSON_COST} accepted. Send fewer prompts, messages or token ids per request.",
            None,
            "request_too_large",
        )


def check_json_tree(data: dict[str, Any]) -> None:
    """400 if `data` nests deeper than MAX_JSON_DEPTH or holds a string (key or value) with
    an unpaired surrogate; the error names the top-level field it is under. Iterative: it
    must not recurse on the very input it guards against."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(field)
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, field or key)
                    stack.append((item, depth + 1, field or key))
            else:
                stack.extend((item, depth + 1, field) for item in value)


def _check_text(text: str, field: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = f"{field!r}" if field else "the request body"
        raise bad_request(
            f"Invalid value for {where}: the text holds an unpaired UTF-16 surrogate "
            "(\\ud800-\\udfff), which is not a character.",
            field,
        ) from None


def _too_deep(field: str | None = None) -> OpenAIError:
    if field is None:
        return bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    return bad_request(
        f"Invalid value for {field!r}: it nests deeper than {MAX_JSON_DEPTH} levels.", field
    )


def _too_large(limit_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body exceeds the limit of {limit_bytes} bytes.",
        None,
        "request_too_large",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")
