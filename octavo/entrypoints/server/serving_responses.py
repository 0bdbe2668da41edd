"""`/v1/responses`: OpenAI's Responses API as vLLM 0.32 serves it, over the chat path.

A request becomes a chat completion request (instructions a system message, input items chat
messages, function tools chat tools, `text.format` a response_format) that
OpenAIServingChat.prepare_request renders, samples and parses exactly as /v1/chat/completions
would: the same text, tool calls and thinking. Owns the translation, the response object and
its output items (reasoning, message, function_call), the stream's events (OpenAI's names and
order, numbered by `sequence_number`), and the response store:

- `store` (the default) keeps each finished response, and the conversation that led to it, in
  memory: at most `max_stored_responses` of them, the least recently used (created, read or
  continued) dropped first; 0 stores nothing (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE:
  `store` is then ignored, and `background` refused);
- `previous_response_id` continues a stored response: its conversation without its system
  messages (instructions do not carry over), its output (thinking, text and function calls),
  then the new input;
- `background: true` (needs `store`, not with `stream`) answers at once with a "queued"
  response that GET /v1/responses/{id} follows to its end; POST .../cancel stops it.

Errors name the Responses field (`input`, `max_output_tokens`, `text`, ...), not the chat one.
The items' translation lives in responses_items.py, the stream's events in responses_stream.py.

Must not: render, sample or parse model output itself (the chat path does), or step the engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from octavo.core.request import FinishReason
from octavo.entrypoints.server.errors import (
    OpenAIError,
    bad_request,
)
from octavo.entrypoints.server.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from octavo.entrypoints.server.request_body import parse_body, read_body
from octavo.entrypoints.server.responses_items import (
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    function_call_item,
    input_messages,
    item_id,
    message_item,
    output_messages,
    reasoning_item,
    template_kwargs,
)
from octavo.entrypoints.server.responses_stream import EventWriter, StreamItems
from octavo.entrypoints.server.serving_chat import OpenAIServingChat
from octavo.entrypoints.server.serving_common import (
    ServingContext,
    chat_request_from,
    engine_error_to_openai,
    prepare,
    renamed,
    respond_run,
)

# Chat request fields -> the Responses fields a client sets for them (for error messages).
_RENAMED = {
    "messages": "input",
    "prompt": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}
# The sampling fields a Responses request shares with chat, copied when set.
_SHARED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
)
# Statuses a background response can still be cancelled in.
_RUNNING = ("queued", "in_progress")


# --- the store ------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    response: ResponsesResponse
    # The conversation up to and including this response's output, as chat messages (the
    # instructions, a system message, left out: they do not carry over).
    messages: list[dict[str, Any]] = field(default_factory=list)
    # A background response's run (None once it ends, or for a foreground one).
    task: asyncio.Task | None = None


class ResponseStore:
    """At most `max_responses` responses in memory, least recently used dropped first. Read
    from preparation threads and the event loop alike, hence the lock."""

    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def put(self, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._responses[stored.response.id] = stored
            self._responses.move_to_end(stored.response.id)
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)

    def __len__(self) -> int:
        return len(self._responses)


def _not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param)


# --- the handler ----------------------------------------------------------------------------


class OpenAIServingResponses:
    def __init__(
        self, context: ServingContext, chat: OpenAIServingChat, max_stored_responses: int
    ) -> None:
        self.context = context
        self.chat = chat
        self.store = ResponseStore(max_stored_responses)

    async def create(self, raw_request: Request) -> Response:
        context = self.context
        body = await read_body(
            raw_request, context.max_request_body_bytes, context.body_read_timeout_s
        )
        run = await prepare(context, self._prepare, body, time.monotonic())
        if run.request.background:
            return _json(self._start_background(run))
        return await respond_run(context, raw_request, run)

    def retrieve(
        self, response_id: str, stream: str | None, starting_after: str | None
    ) -> Response:
        if stream not in (None, "false", "False", "0"):
            raise bad_request("Streaming a stored response is not supported by octavo.", "stream")
        if starting_after is not None:
            raise bad_request(
                "starting_after is only for streaming, which octavo does not do.", "starting_after"
            )
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return _json(stored.response)

    async def cancel(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        if stored.response.status not in _RUNNING:
            raise bad_request("Cannot cancel a synchronous response.", "response_id")
        stored.response.status = "cancelled"
        task = stored.task
        if task is not None:
            task.cancel()  # closes the engine stream: the request is aborted within a step
            try:
                await task
            except asyncio.CancelledError:
                pass
        return _json(stored.response)

    def _prepare(self, body: bytes, arrival_time: float) -> _ResponsesRun:
        """In a preparation thread: check the request, translate it, and prepare its chat run
        (rendering and tokenizing)."""
        request = parse_body(body, ResponsesRequest)
        if request.background:
            if not request.store:
                raise bad_request("background can only be used when `store` is true", "background")
            if not self.store.enabled:
                raise bad_request(
                    "This server stores no responses (--max-stored-responses 0) and therefore "
                    "does not support the background mode.",
                    "background",
                )
            if request.stream:
                raise bad_request(
                    "background with stream is not supported by octavo: poll GET "
                    "/v1/responses/{id} instead.",
                    "background",
                )
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise _not_found(request.previous_response_id, "previous_response_id")
            history = [m for m in previous.messages if m["role"] != "system"]
        conversation = history + input_messages(request.input)
        instructions = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        tools = chat_tools(request.tools)
        fields: dict[str, Any] = {
            name: value for name in _SHARED_FIELDS if (value := getattr(request, name)) is not None
        }
        fields.update(
            model=request.model,
            messages=instructions + conversation,
            max_completion_tokens=request.max_output_tokens,
            tools=tools,
            tool_choice=chat_tool_choice(request.tool_choice, tools is not None),
            response_format=chat_response_format(request),
            chat_template_kwargs=template_kwargs(request),
            stream=bool(request.stream),
        )
        if request.structured_outputs is not None:
            fields["structured_outputs"] = request.structured_outputs.model_dump(
                by_alias=True, exclude_none=True
            )
        if request.stream:
            fields["stream_options"] = {"include_usage": True}
        chat_request = chat_request_from(fields, _RENAMED)
        try:
            chat_run = self.chat.prepare_request(chat_request, arrival_time)
        except OpenAIError as exc:
            raise renamed(exc, _RENAMED) from None
        return _ResponsesRun(self, request, chat_run, conversation)

    def _start_background(self, run: _ResponsesRun) -> ResponsesResponse:
        response = run.response("queued")
        stored = StoredResponse(response, run.conversation)
        self.store.put(stored)

        async def finish() -> None:
            stored.response.status = "in_progress"
            try:
                final = await run.collect()
            except OpenAIError as exc:
                if stored.response.status != "cancelled":
                    stored.response.status = "failed"
                    stored.response.error = {
                        "code": exc.code or "server_error",
                        "message": exc.message,
                    }
            else:
                if stored.response.status != "cancelled":
                    stored.response = final
            finally:
                stored.task = None

        stored.task = asyncio.get_running_loop().create_task(finish())
        return response


def _dumped(value: Any) -> dict[str, Any] | None:
    """A request's config object as the client sent it (its own field names)."""
    return None if value is None else value.model_dump(by_alias=True, exclude_none=True)


def _json(response: ResponsesResponse) -> Response:
    return Response(response.model_dump_json(), media_type="application/json")


class _ResponsesRun:
    """One Responses request over its chat run: the whole response, or its events."""

    def __init__(
        self,
        serving: OpenAIServingResponses,
        request: ResponsesRequest,
        chat_run: Any,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.serving = serving
        self.request = request
        self.chat_run = chat_run
        self.engine_requests = chat_run.engine_requests
        self.conversation = conversation
        self.response_id = item_id("resp")
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        finish_reason: str | None = None,
    ) -> ResponsesResponse:
        request = self.request
        params = self.chat_run.engine_request.sampling_params
        if finish_reason == FinishReason.LENGTH:
            status = "incomplete"
        usage = None if finish_reason is None else self._usage()
        return ResponsesResponse(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            model=self.serving.context.model_name,
            instructions=request.instructions,
            output=output or [],
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=params.temperature,
            top_p=params.top_p,
            # vLLM's echo: "auto" (the default) without tools is "none".
            tool_choice="none"
            if not request.tools and request.tool_choice == "auto"
            else request.tool_choice,
            tools=request.tools,
            background=bool(request.background),
            max_output_tokens=self._max_output_tokens(params.max_tokens),
            previous_response_id=request.previous_response_id,
            reasoning=_dumped(request.reasoning),
            service_tier=request.service_tier,
            store=bool(request.store),
            text=_dumped(request.text),
            metadata=request.metadata,
            user=request.user,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            usage=usage,
        )

    def _max_output_tokens(self, max_tokens: int | None) -> int:
        """The effective limit: the request's (or the server's default), else the room the
        prompt leaves in max_model_len."""
        if max_tokens is not None:
            return max_tokens
        return self.serving.context.max_model_len - self.chat_run.num_prompt_tokens

    def _usage(self) -> ResponseUsage:
        run = self.chat_run
        num_input = run.num_prompt_tokens
        num_output = sum(choice.num_tokens for choice in run.choices)
        return ResponseUsage(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=run.usage.num_cached_tokens),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=run.num_reasoning_tokens),
            total_tokens=num_input + num_output,
        )

    def _finish(self, output: list[dict[str, Any]], finish_reason: str | None) -> ResponsesResponse:
        response = self.response("completed", output, finish_reason or FinishReason.STOP)
        if self.request.store:
            messages = self.conversation + output_messages(output)
            self.serving.store.put(StoredResponse(response, messages))
        return response

    async def collect(self) -> ResponsesResponse:
        chat_response = await self.chat_run.collect()
        choice = chat_response.choices[0]
        message = choice.message
        first = self.chat_run.choices[0]
        output: list[dict[str, Any]] = []
        if first.parser is None and first.reasoning is None:
            output.append(message_item(item_id("msg"), message.content or "", "completed"))
        else:
            if message.reasoning and self.request.include_reasoning:
                output.append(reasoning_item(item_id("rs"), message.reasoning, None))
            if message.content:
                output.append(message_item(item_id("msg"), message.content, "completed"))
            calls = message.tool_calls or []
            if self.request.parallel_tool_calls is False:
                calls = calls[:1]
            for call in calls:
                output.append(
                    function_call_item(
                        item_id("fc"),
                        call.id,
                        call.function.name,
                        call.function.arguments,
                        "completed",
                    )
                )
        return self._finish(output, self.chat_run.choices[0].finish_reason)

    async def stream(self) -> AsyncIterator[str]:
        events = EventWriter()
        created = self.response("in_progress").model_dump(mode="json")
        yield events.send("response.created", response=created)
        yield events.send("response.in_progress", response=created)
        items = StreamItems(events, self.request)
        finish_reason = None
        try:
            async with aclosing(self.chat_run.chunks()) as chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        finish_reason = choice.finish_reason or finish_reason
                        for text in items.feed(choice.delta):
                            yield text
        except Exception as exc:
            error = engine_error_to_openai(exc)
            yield events.send("error", code=error.code, message=error.message, param=error.param)
            return
        for text in items.close():
            yield text
        final = self._finish(items.output, finish_reason)
        yield events.send("response.completed", response=final.model_dump(mode="json"))
