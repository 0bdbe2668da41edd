"""Pydantic models of Anthropic's Messages API (`/v1/messages`), as vLLM 0.32 serves it.

Owns the request bodies (messages, count_tokens) and the response and stream-event shapes.
Unknown fields are ignored, as vLLM does; vLLM's extras that octavo does not implement are
`Refused` (a 400 naming them unless off).

Must not: hold behaviour beyond parsing and shaping; serving_messages.py turns a request into
a chat request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from octavo.entrypoints.server.protocol import Refused


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class AnthropicContentBlock(_Request):
    """One block of a message (text, tool_use, tool_result, thinking, ...); which fields a
    type needs is checked by the handler, which names the block."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class AnthropicMessage(_Request):
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicContentBlock]


class AnthropicTool(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    # Tool search (vLLM passes it to the chat template); octavo does not implement it.
    defer_loading: bool | None = None


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicOutputFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class AnthropicOutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicOutputFormat | None = None


class AnthropicThinking(_Request):
    """`enabled` (a token budget for the thinking), `disabled` or `adaptive`."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None


class _Conversation(_Request):
    """What a messages request and a count_tokens request share."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[AnthropicContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    # vLLM's extra.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model_given(cls, value: str) -> str:
        if not value:
            raise ValueError("model is required")
        return value


class AnthropicMessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Anthropic's request metadata (user_id): informational, as in vLLM.
    metadata: dict[str, Any] | None = None
    # vLLM's extras octavo refuses unless off (protocol.REFUSED_OFF_VALUES).
    cache_salt: Refused = None
    watermarking: Refused = None
    kv_transfer_params: Refused = None
    ec_transfer_params: Refused = None
    vllm_xargs: Refused = None
    mm_payload: Refused = None
    return_mm_kwargs: Refused = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_tokens must be positive")
        return value


class AnthropicCountTokensRequest(_Conversation):
    pass


# --- responses ------------------------------------------------------------------------------


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class AnthropicMessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    # Blocks as Anthropic shapes them ({"type": "text", "text": ...}, ...).
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage
