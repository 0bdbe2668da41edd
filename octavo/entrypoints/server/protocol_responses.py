"""Pydantic models of OpenAI's Responses API (`/v1/responses`), the subset vLLM 0.32 serves.

Owns the request body (types and the refusals that need no engine: every field vLLM accepts
that octavo does not implement is a 400 naming it unless it has its "off" value), and the
shapes of the response object, its output items and its stream events. Unknown fields are
ignored, as vLLM does. `input` items stay plain dicts here: serving_responses.py reads them
one by one, so that an error can say which item is wrong.

Must not: hold behaviour beyond parsing and shaping; serving_responses.py turns a request
into a chat request.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from octavo.entrypoints.server.protocol import Refused, StructuredOutputsRequest


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ResponseFormatText(_Request):
    """`text.format`: plain text, any JSON object, or a JSON schema (OpenAI's flat shape)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(_Request):
    format: ResponseFormatText | None = None
    # OpenAI's hint for gpt-5 models; vLLM passes it nowhere.
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    """`reasoning`: `effort` goes to the chat template (reasoning_effort, and enable_thinking
    unless the request sets it), as vLLM does; summaries are not made."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    # Text (one user message) or a list of items, checked item by item by the handler.
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # Function tools ({"type": "function", "name", "parameters", ...}), checked by the handler.
    tools: list[Any] = Field(default_factory=list)
    # "auto", "none", "required" or {"type": "function", "name": ...}; checked by the handler.
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    text: ResponseTextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = True
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    # vLLM's sampling extras, as on chat.
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    # Fields vLLM accepts that octavo does not implement: 400 unless off
    # (protocol.REFUSED_OFF_VALUES).
    include: Refused = None
    max_tool_calls: Refused = None
    prompt: Refused = None
    prompt_cache_key: Refused = None
    top_logprobs: Refused = None
    truncation: Refused = None
    enable_response_messages: Refused = None
    previous_input_messages: Refused = None
    mm_payload: Refused = None
    watermarking: Refused = None
    request_id: Refused = None
    session_id: Refused = None
    media_io_kwargs: Refused = None
    mm_processor_kwargs: Refused = None
    return_mm_kwargs: Refused = None
    cache_salt: Refused = None
    vllm_xargs: Refused = None
    kv_transfer_params: Refused = None
    ec_transfer_params: Refused = None


# --- the response object --------------------------------------------------------------------


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesResponse(BaseModel):
    """The response object: what the request asked (echoed, with the effective sampling
    values) and the output items (dicts in OpenAI's item shapes, see serving_responses.py)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    model: str
    instructions: str | None = None
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float
    top_p: float
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    background: bool = False
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    usage: ResponseUsage | None = None
