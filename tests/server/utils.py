"""Checks the server tests share."""

from __future__ import annotations

import httpx


def assert_error(
    response: httpx.Response, param: str | None, fragment: str, status: int = 400
) -> None:
    """An OpenAI error object with this status and param, its message holding `fragment`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert fragment in error["message"], error["message"]
