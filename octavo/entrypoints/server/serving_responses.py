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

Must not: render, sample or parse model output itself (the chat path does), or step the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
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
from octavo.entrypoints.server.serving_chat import OpenAIServingChat
from octavo.entrypoints.server.serving_common import (
    ServingContext,
    chat_request_from,
    engine_error_to_openai,
    prepare,
    renamed,
    respond_run,
)

logger = logging.getLogger(__name__)

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
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
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


# --- input items -> chat messages -------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content: only text parts (input_text, output_text) are supported, "
                f"got {kind or type(part).__name__!r}.",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _add_assistant(messages: list[dict[str, Any]], key: str, value: Any) -> None:
    """Thinking, text and calls of one assistant turn come as separate items: they go into
    one assistant message while it has none of that kind yet (calls always join)."""
    last = _last_assistant(messages)
    if key == "tool_calls":
        if last is not None:
            last.setdefault("tool_calls", []).append(value)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [value]})
        return
    if last is not None and last.get(key) is None:
        last[key] = value
        return
    messages.append({"role": "assistant", "content": None, key: value})


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """`input` -> chat messages; 400 naming `input` for an item octavo does not take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise bad_request(f"{where} must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(_INPUT_ROLES)}; got {role!r}.",
                    "input",
                )
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                _add_assistant(messages, "content", text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call needs name and call_id.", "input")
            arguments = item.get("arguments", "{}")
            call = {"id": item["call_id"], "type": "function"}
            _add_assistant(
                messages,
                "tool_calls",
                {**call, "function": {"name": item["name"], "arguments": arguments}},
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs call_id.", "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if item.get("encrypted_content"):
                raise bad_request(f"{where}: encrypted reasoning is not supported.", "input")
            text = "".join(p.get("text", "") for p in parts if isinstance(p, Mapping))
            _add_assistant(messages, "reasoning", text)
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r}.", "input")
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of its assistant turn."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
            _add_assistant(messages, "reasoning", text)
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            _add_assistant(messages, "content", text)
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            _add_assistant(messages, "tool_calls", call)
    return messages


# --- tools, formats -------------------------------------------------------------------------


def chat_tools(tools: list[Any]) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: type, name, description, parameters, strict) -> chat
    tools; any other tool type (web search, file search, MCP, ...) is a 400 naming `tools`."""
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise bad_request(
                f"tools[{index}]: only function tools are supported, got type {kind!r}.", "tools"
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        converted.append({"type": "function", "function": function})
    return converted or None


def chat_tool_choice(tool_choice: Any, has_tools: bool) -> Any:
    """vLLM's rules: "auto" (the default) and "none" without tools are "none"; "required"
    or a named function needs tools."""
    if tool_choice in ("auto", "none", "required"):
        if not has_tools:
            if tool_choice == "required":
                raise bad_request(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                    "tool_choice",
                )
            return "none"
        return tool_choice
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = tool_choice.get("name")
        if not isinstance(name, str) or not name or not has_tools:
            raise bad_request(
                "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}; '
        f"got {tool_choice!r}.",
        "tool_choice",
    )


def chat_response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text = request.text
    if text is None:
        return None
    if text.verbosity is not None:
        raise bad_request("text.verbosity is not supported by octavo.", "text")
    form = text.format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.schema_ is None:
        raise bad_request("text.format.schema is required when type is 'json_schema'.", "text")
    if request.structured_outputs is not None:
        raise bad_request(
            "Cannot specify both structured_outputs and text.format", "structured_outputs"
        )
    schema = {"name": form.name, "schema": form.schema_, "strict": form.strict}
    return {"type": "json_schema", "json_schema": schema}


def template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, plus `reasoning.effort` as vLLM passes it (reasoning_effort,
    and enable_thinking unless the request sets it)."""
    kwargs = dict(request.chat_template_kwargs or {})
    reasoning = request.reasoning
    if reasoning is not None:
        if reasoning.summary is not None or reasoning.generate_summary is not None:
            raise bad_request("reasoning.summary is not supported by octavo.", "reasoning")
        if reasoning.effort is not None:
            kwargs["reasoning_effort"] = reasoning.effort
            kwargs.setdefault("enable_thinking", reasoning.effort != "none")
    return kwargs or None


# --- output items ---------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if text else [],
    }


def reasoning_item(item_id: str, text: str, status: str | None) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


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
        self.response_id = _item_id("resp")
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
            tool_choice=request.tool_choice,
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
            output.append(message_item(_item_id("msg"), message.content or "", "completed"))
        else:
            if message.reasoning and self.request.include_reasoning:
                output.append(reasoning_item(_item_id("rs"), message.reasoning, None))
            if message.content:
                output.append(message_item(_item_id("msg"), message.content, "completed"))
            calls = message.tool_calls or []
            if self.request.parallel_tool_calls is False:
                calls = calls[:1]
            for call in calls:
                output.append(
                    function_call_item(
                        _item_id("fc"),
                        call.id,
                        call.function.name,
                        call.function.arguments,
                        "completed",
                    )
                )
        return self._finish(output, self.chat_run.choices[0].finish_reason)

    async def stream(self) -> AsyncIterator[str]:
        events = _EventWriter()
        created = self.response("in_progress").model_dump(mode="json")
        yield events.send("response.created", response=created)
        yield events.send("response.in_progress", response=created)
        items = _StreamItems(events, self.request)
        finish_reason = None
        try:
            async for chunk in self.chat_run.chunks():
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


class _EventWriter:
    """SSE events, `event:` named by their type, numbered from 0 in the order sent."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class _StreamItems:
    """Chat deltas -> the output items' events. One item is open at a time (thinking, text,
    or one function call); a delta of another kind, or of another call, closes it and opens
    the next, as vLLM's simple (non-harmony) stream does."""

    def __init__(self, events: _EventWriter, request: ResponsesRequest) -> None:
        self.events = events
        self.request = request
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None  # "reasoning", "message", "function_call" or None
        self.item_id = ""
        self.text = ""
        self.call: dict[str, Any] = {}  # the open call's call_id, name and index

    def feed(self, delta: Any) -> list[str]:
        sent: list[str] = []
        if delta.reasoning and self.request.include_reasoning:
            sent += self._switch("reasoning")
            sent.append(self._delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            sent += self._switch("message")
            sent.append(self._delta("response.output_text.delta", delta.content, logprobs=[]))
        for call in delta.tool_calls or []:
            if self.request.parallel_tool_calls is False and call.index > 0:
                continue
            if call.id is not None:
                sent += self._switch(None)
                name = call.function.name if call.function else ""
                sent += self._open_call(call.id, name, call.index)
            arguments = call.function.arguments if call.function else None
            if arguments:
                sent.append(self._delta("response.function_call_arguments.delta", arguments))
        return sent

    def _delta(self, kind: str, text: str, **extra: Any) -> str:
        self.text += text
        return self.events.send(
            kind,
            item_id=self.item_id,
            output_index=len(self.output),
            **({} if kind == "response.function_call_arguments.delta" else {"content_index": 0}),
            delta=text,
            **extra,
        )

    def _switch(self, kind: str | None) -> list[str]:
        if self.kind == kind:
            return []
        sent = self.close()
        if kind == "message":
            self._open(
                "msg",
                message_item("", "", "in_progress"),
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                sent,
            )
        elif kind == "reasoning":
            self._open(
                "rs",
                reasoning_item("", "", "in_progress"),
                {"type": "reasoning_text", "text": ""},
                sent,
            )
        self.kind = kind
        return sent

    def _open(
        self, prefix: str, item: dict[str, Any], part: dict[str, Any], sent: list[str]
    ) -> None:
        self.item_id = _item_id(prefix)
        self.text = ""
        item["id"] = self.item_id
        if item["type"] == "reasoning":
            item["content"] = []
        output_index = len(self.output)
        sent.append(
            self.events.send("response.output_item.added", output_index=output_index, item=item)
        )
        sent.append(
            self.events.send(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=output_index,
                content_index=0,
                part=part,
            )
        )

    def _open_call(self, call_id: str, name: str, index: int) -> list[str]:
        self.kind = "function_call"
        self.item_id = _item_id("fc")
        self.text = ""
        self.call = {"call_id": call_id, "name": name, "index": index}
        item = function_call_item(self.item_id, call_id, name, "", "in_progress")
        return [
            self.events.send("response.output_item.added", output_index=len(self.output), item=item)
        ]

    def close(self) -> list[str]:
        """The open item's done events; nothing when none is open."""
        kind, self.kind = self.kind, None
        output_index = len(self.output)
        where = {"item_id": self.item_id, "output_index": output_index}
        if kind == "message":
            item = message_item(self.item_id, self.text, "completed")
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": None}
            sent = [
                self.events.send(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                ),
                self.events.send("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "reasoning":
            item = reasoning_item(self.item_id, self.text, "completed")
            part = {"type": "reasoning_text", "text": self.text}
            sent = [
                self.events.send(
                    "response.reasoning_text.done", **where, content_index=0, text=self.text
                ),
                self.events.send("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "function_call":
            item = function_call_item(
                self.item_id, self.call["call_id"], self.call["name"], self.text, "completed"
            )
            sent = [
                self.events.send(
                    "response.function_call_arguments.done",
                    **where,
                    name=self.call["name"],
                    arguments=self.text,
                )
            ]
        else:
            return []
        sent.append(
            self.events.send("response.output_item.done", output_index=output_index, item=item)
        )
        self.output.append(item)
        return sent
