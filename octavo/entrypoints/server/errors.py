"""OpenAI's error object and the mapping of every failure to a status and that object.

Owns `OpenAIError` (raised by handlers), the JSON shape `{"error": {message, type, param,
code}}`, and the exception handlers the app installs so that no framework default (FastAPI's
422 validation dump, Starlette's `{"detail": ...}`) reaches a client.

Must not: know about the engine's internals; it only turns messages into responses.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client closed the connection before its request body arrived: nobody to answer."""


# OpenAI's error types by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        # Response headers beside the error body (a shed request's Retry-After).
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.status_code, exc.message, exc.param, exc.code),
        status_code=exc.status_code,
        headers=exc.headers or None,
    )


def from_value_error(
    exc: ValueError, known_params: set[str], rename: dict[str, str]
) -> OpenAIError:
    """A ValueError from SamplingParams or the input processor names the parameter in its
    text ("max_tokens must be ...", "prompt must not be empty"); find it for `param`."""
    message = str(exc)
    return bad_request(message, param_in_message(message, known_params, rename))


def param_in_message(message: str, known_params: set[str], rename: dict[str, str]) -> str | None:
    words = re.findall(r"[A-Za-z_]+", message)
    for word in words:
        if word in known_params:
            return rename.get(word, word)
    return None


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """One readable line from pydantic's errors, naming the first bad field."""
    first = exc.errors(include_url=False)[0]
    location = [str(part) for part in first.get("loc", ()) if not isinstance(part, int)]
    # Union members add their type names to the location; the field is the first part.
    param = location[0] if location else None
    message = first.get("msg", "invalid value")
    if param is None:
        return bad_request(f"Invalid request: {message}.")
    return bad_request(f"Invalid value for {param!r}: {message}.", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0].get("loc", ())) if errors else "body"
        return error_response(bad_request(f"Invalid request at {where}."))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}."
        else:
            message = str(exc.detail)
        response = error_response(OpenAIError(exc.status_code, message))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, _: ClientDisconnected) -> Response:
        # Nobody to answer: one line, no traceback (a client may do this on purpose).
        logger.info("client left %s %s before its body arrived", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return error_response(OpenAIError(500, f"Internal server error: {exc!r}"))
