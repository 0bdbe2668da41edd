"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API as vLLM 0.32
serves it, over the chat path.

A request becomes a chat completion request (system text a system message, text blocks
content, `tool_use` blocks assistant tool calls, `tool_result` blocks tool messages, tools and
tool_choice their chat forms, stop_sequences `stop`) that OpenAIServingChat.prepare_request
renders, samples and parses exactly as /v1/chat/completions would. Owns the translation, the
message object (text, thinking and tool_use blocks; `stop_reason` end_turn, max_tokens,
stop_sequence or tool_use, with the matched `stop_sequence`), the stream's events (Anthropic's
message_start, content_block_start/delta/stop, message_delta with the stop reason and usage,
message_stop) and errors in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`) with the status the chat path gives.

Must not: render, sample or parse model output itself (the chat path does), or step the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.core.request import FinishReason
from octavo.entrypoints.server.chat_render import chat_render_from
from octavo.entrypoints.server.errors import OpenAIError, bad_request
from octavo.entrypoints.server.protocol import ChatCompletionChunk
from octavo.entrypoints.server.protocol_anthropic import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicUsage,
)
from octavo.entrypoints.server.request_body import parse_body, read_body
from octavo.entrypoints.server.serving_chat import OpenAIServingChat
from octavo.entrypoints.server.serving_common import (
    ServingContext,
    chat_request_from,
    engine_error_to_openai,
    prepare,
    renamed,
    respond_run,
)
from octavo.entrypoints.server.tool_parsers.tool_choice import check_tools

# Chat request fields -> the Messages fields a client sets for them (for error messages).
_RENAMED = {
    "max_completion_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config",
}
# Anthropic's error types by status (the body's error.type).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# Claude Code's system block with a per-request hash: dropped (as vLLM does), so that it does
# not defeat the prefix cache.
_BILLING_HEADER = "x-anthropic-billing-header"


def anthropic_error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        _error_body(error), status_code=error.status_code, headers=error.headers or None
    )


def _error_body(error: OpenAIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


# --- request -> chat request ----------------------------------------------------------------


def _system_text(blocks: str | list[AnthropicContentBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return "" if blocks is None or blocks.startswith(_BILLING_HEADER) else blocks
    return "".join(
        block.text
        for block in blocks
        if block.type == "text" and block.text and not block.text.startswith(_BILLING_HEADER)
    )


def _tool_result_text(block: AnthropicContentBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for item in content:
        if item.get("type") != "text" or not isinstance(item.get("text"), str):
            raise bad_request(
                f"{where}.content: only text blocks are supported in a tool_result, got "
                f"{item.get('type')!r}.",
                "messages",
            )
        texts.append(item["text"])
    return "\n".join(texts)


def _convert_message(
    message: AnthropicMessage, index: int, chat_messages: list[dict[str, Any]]
) -> None:
    """Append `message` as chat messages: its tool results first (tool messages), then the
    message itself if it has text, thinking or calls (vLLM's order)."""
    if message.role == "system":
        text = _system_text(message.content)
        if text:
            chat_messages.append({"role": "system", "content": text})
        return
    if isinstance(message.content, str):
        chat_messages.append({"role": message.role, "content": message.content})
        return
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for number, block in enumerate(message.content):
        where = f"messages[{index}].content[{number}]"
        if block.type == "text":
            if block.text:
                texts.append(block.text)
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type in ("redacted_thinking", "tool_reference"):
            pass  # opaque to the model (vLLM drops them too)
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise bad_request(f"{where}: a tool_use block needs id and name.", "messages")
            arguments = json.dumps(block.input or {})
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type == "tool_result":
            text = _tool_result_text(block, where)
            if message.role == "user":
                tool_call_id = block.tool_use_id or ""
                chat_messages.append(
                    {"role": "tool", "tool_call_id": tool_call_id, "content": text}
                )
            else:
                texts.append(f"Tool result: {text}")
        else:
            raise bad_request(
                f"{where}: content blocks of type {block.type!r} are not supported (text, "
                "tool_use, tool_result and thinking are).",
                "messages",
            )
    chat_message: dict[str, Any] = {"role": message.role}
    if texts:
        chat_message["content"] = texts[0] if len(texts) == 1 else "\n".join(texts)
    if thinking:
        chat_message["reasoning"] = "".join(thinking)
    if calls:
        chat_message["tool_calls"] = calls
    if len(chat_message) > 1:
        chat_messages.append(chat_message)


def _template_kwargs(request: AnthropicCountTokensRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, with the thinking switch and effort as vLLM passes them."""
    kwargs = dict(request.chat_template_kwargs or {})
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":
        raise bad_request(
            "thinking.type 'enabled' (a token budget for the thinking) is not supported by "
            "octavo; use 'adaptive', or 'disabled'.",
            "thinking",
        )
    if thinking is not None and thinking.type == "disabled":
        kwargs.setdefault("enable_thinking", False)
        kwargs.setdefault("reasoning_effort", "none")
    config = request.output_config
    if config is not None and config.effort is not None:
        kwargs["reasoning_effort"] = config.effort
    return kwargs or None


def _chat_fields(request: AnthropicCountTokensRequest) -> dict[str, Any]:
    """The chat request fields of a messages (or count_tokens) request's conversation."""
    chat_messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        chat_messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        _convert_message(message, index, chat_messages)
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages,
        "chat_template_kwargs": _template_kwargs(request),
    }
    if request.tools:
        tools = []
        for tool in request.tools:
            if tool.defer_loading:
                raise bad_request("tools: defer_loading is not supported by octavo.", "tools")
            function = {
                "name": tool.name,
                "description": tool.description,
                "parameters": {"type": "object", **tool.input_schema},
                "strict": tool.strict,
            }
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    config = request.output_config
    if config is not None and config.format is not None and config.format.schema_ is not None:
        schema = {"name": config.format.type, "schema": config.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return fields


# --- the handler ----------------------------------------------------------------------------


class AnthropicServingMessages:
    def __init__(self, context: ServingContext, chat: OpenAIServingChat) -> None:
        self.context = context
        self.chat = chat

    async def create(self, raw_request: Request) -> Response:
        context = self.context
        try:
            body = await read_body(
                raw_request, context.max_request_body_bytes, context.body_read_timeout_s
            )
            run = await prepare(context, self._prepare, body, time.monotonic())
            return await respond_run(context, raw_request, run)
        except OpenAIError as exc:
            return anthropic_error(exc)

    async def count_tokens(self, raw_request: Request) -> Response:
        context = self.context
        try:
            body = await read_body(
                raw_request, context.max_request_body_bytes, context.body_read_timeout_s
            )
            num_tokens = await prepare(context, self._count_tokens, body)
        except OpenAIError as exc:
            return anthropic_error(exc)
        return JSONResponse(
            {
                "input_tokens": num_tokens,
                "context_management": {"original_input_tokens": num_tokens},
            }
        )

    def _prepare(self, body: bytes, arrival_time: float) -> _MessagesRun:
        request = parse_body(body, AnthropicMessagesRequest)
        fields = _chat_fields(request)
        fields.update(
            max_completion_tokens=request.max_tokens,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stream=bool(request.stream),
        )
        if request.stream:
            fields["stream_options"] = {"include_usage": True}
        chat_request = chat_request_from(fields, _RENAMED)
        try:
            chat_run = self.chat.prepare_request(chat_request, arrival_time)
        except OpenAIError as exc:
            raise renamed(exc, _RENAMED) from None
        return _MessagesRun(self.context, request, chat_run)

    def _count_tokens(self, body: bytes) -> int:
        """The prompt tokens the same conversation gets on /v1/messages (tools rendered)."""
        request = parse_body(body, AnthropicCountTokensRequest)
        chat_request = chat_request_from(_chat_fields(request), _RENAMED)
        render = chat_render_from(chat_request, check_tools(chat_request.tools), self.context)
        processor = self.context.async_engine.engine.input_processor
        return len(render(processor).prompt_token_ids)


def _stop_reason(
    finish_reason: str | None, stop_reason: int | str | None, called: bool
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish (vLLM's mapping): max_tokens wins; a
    matched stop string (a str stop_reason) is stop_sequence; a call made is tool_use."""
    if finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if finish_reason not in (FinishReason.STOP, "tool_calls"):
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    return "end_turn", None


class _MessagesRun:
    """One Messages request over its chat run: the whole message, or its events."""

    def __init__(
        self, context: ServingContext, request: AnthropicMessagesRequest, chat_run: Any
    ) -> None:
        self.context = context
        self.request = request
        self.chat_run = chat_run
        self.engine_requests = chat_run.engine_requests
        self.message_id = f"msg_{uuid.uuid4().hex}"
        parallel = request.tool_choice is None or not request.tool_choice.disable_parallel_tool_use
        self.max_calls = None if parallel else 1

    def _usage(self, num_output_tokens: int) -> AnthropicUsage:
        """Anthropic counts cache reads apart from input_tokens (vLLM's split)."""
        usage = self.chat_run.usage
        return AnthropicUsage(
            input_tokens=max(0, usage.num_prompt_tokens - usage.num_cached_tokens),
            output_tokens=num_output_tokens,
            cache_read_input_tokens=usage.num_cached_tokens,
        )

    async def collect(self) -> AnthropicMessagesResponse:
        chat_response = await self.chat_run.collect()
        choice = chat_response.choices[0]
        message = choice.message
        content: list[dict[str, Any]] = []
        if message.reasoning:
            content.append(
                {"type": "thinking", "thinking": message.reasoning, "signature": uuid.uuid4().hex}
            )
        if message.content:
            content.append({"type": "text", "text": message.content})
        calls = (message.tool_calls or [])[: self.max_calls]
        for call in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": json.loads(call.function.arguments),
                }
            )
        stop_reason, stop_sequence = _stop_reason(
            choice.finish_reason, choice.stop_reason, bool(calls)
        )
        return AnthropicMessagesResponse(
            id=self.message_id,
            # An empty answer is one empty text block (Anthropic's shape; clients read [0]).
            content=content or [{"type": "text", "text": ""}],
            model=chat_response.model,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=self._usage(chat_response.usage.completion_tokens),
        )

    async def stream(self) -> AsyncIterator[str]:
        blocks = _StreamBlocks(self.max_calls)
        started = False
        finish_reason = stop_reason = None
        try:
            async with aclosing(self.chat_run.chunks()) as chunks:
                async for chunk in chunks:
                    if not started:
                        started = True
                        yield _event("message_start", message=self._start())
                    for text in self._chunk_events(chunk, blocks):
                        yield text
                    if chunk.choices:
                        finish_reason = chunk.choices[0].finish_reason or finish_reason
                        stop_reason = chunk.choices[0].stop_reason or stop_reason
        except Exception as exc:
            yield _event("error", error=_error_body(engine_error_to_openai(exc))["error"])
            return
        for text in blocks.close():
            yield text
        reason, sequence = _stop_reason(finish_reason, stop_reason, blocks.called)
        num_output = sum(choice.num_tokens for choice in self.chat_run.choices)
        usage = self._usage(num_output).model_dump()
        yield _event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage
        )
        yield _event("message_stop")

    def _start(self) -> dict[str, Any]:
        start = AnthropicMessagesResponse(
            id=self.message_id, content=[], model=self.context.model_name, usage=self._usage(0)
        )
        return start.model_dump()

    def _chunk_events(self, chunk: ChatCompletionChunk, blocks: _StreamBlocks) -> list[str]:
        sent: list[str] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning:
                sent += blocks.delta(
                    "thinking", {"type": "thinking_delta", "thinking": delta.reasoning}
                )
            if delta.content:
                sent += blocks.delta("text", {"type": "text_delta", "text": delta.content})
            for call in delta.tool_calls or []:
                sent += blocks.tool_call(call)
        return sent


class _StreamBlocks:
    """Content blocks as events: one open at a time; text, thinking or one tool_use. A delta
    of another kind (or another call) stops the open block and starts the next."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.index = -1  # the open (or last) block's index
        self.kind: str | None = None
        self.call_index: int | None = None
        self.called = False

    def _start(self, block: dict[str, Any]) -> list[str]:
        sent = self.close()
        self.index += 1
        self.kind = block["type"]
        return sent + [_event("content_block_start", index=self.index, content_block=block)]

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        sent: list[str] = []
        if self.kind != kind:
            start = {"type": kind, kind: ""}
            if kind == "thinking":
                start["signature"] = ""
            sent = self._start(start)
        return sent + [_event("content_block_delta", index=self.index, delta=delta)]

    def tool_call(self, call: Any) -> list[str]:
        if self.max_calls is not None and call.index >= self.max_calls:
            return []
        sent: list[str] = []
        if call.id is not None:
            name = call.function.name if call.function else ""
            sent = self._start({"type": "tool_use", "id": call.id, "name": name, "input": {}})
            self.call_index = call.index
            self.called = True
        arguments = call.function.arguments if call.function else None
        if arguments and self.kind == "tool_use" and call.index == self.call_index:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            sent.append(_event("content_block_delta", index=self.index, delta=delta))
        return sent

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        sent = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            sent.append(_event("content_block_delta", index=self.index, delta=delta))
        self.kind = None
        return sent + [_event("content_block_stop", index=self.index)]
