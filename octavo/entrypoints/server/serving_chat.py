"""`POST /v1/chat/completions`: chat messages rendered by the model's template, streaming or not.

Owns message checking (each error names `messages` and says which message is wrong), the chat
response and chunk shapes (a role delta opens each choice's stream), and chat `logprobs`.

Must not: step the engine; rendering and tokenization happen here, before submitting, and are
moved to a worker thread when the conversation is large.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from octavo.engine.async_engine import EngineRequest
from octavo.engine.outputs import CompletionOutput
from octavo.entrypoints.server.errors import bad_request
from octavo.entrypoints.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from octavo.entrypoints.server.serving_common import (
    SSE_DONE,
    PromptUsage,
    ServingContext,
    check_model,
    clamp_logprob,
    decoded,
    engine_error_body,
    engine_error_to_openai,
    make_sampling_params,
    make_usage,
    new_request_id,
    parse_body,
    process_prompt,
    run_unless_disconnected,
    sse,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatTokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingChat:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, raw_request: Request) -> Response:
        context = self.context
        request = await parse_body(
            raw_request, ChatCompletionRequest, context.max_request_body_bytes
        )
        check_model(context, request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true.", "stream_options"
            )
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        messages = check_messages(request.messages)
        rename = {"logprobs": "top_logprobs", "prompt": "messages"}
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            rename["max_tokens"] = "max_completion_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = make_sampling_params(context, request, max_tokens, logprobs, rename)
        processor = context.async_engine.engine.input_processor

        def render():
            return processor.render_chat(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )

        size = sum(len(m["content"] or "") for m in messages)
        processed = await process_prompt(context, render, size, params, rename)
        request_id = new_request_id("chatcmpl")
        engine_request = EngineRequest(request_id, processed, params, time.monotonic())
        run = _Run(context, request, engine_request)
        if request.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        response = await run_unless_disconnected(raw_request, run.collect())
        if response is None:
            return Response(status_code=499)
        return Response(response.model_dump_json(), media_type="application/json")


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the template's {role, content: str} dicts; 400 naming `messages`."""
    if not messages:
        raise bad_request("messages must be a non-empty list.", "messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise bad_request(f"messages[{index}] must be an object.", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}.",
                "messages",
            )
        content = _content_text(message.get("content"), index, role)
        checked.append({**message, "content": content})
    return checked


def _content_text(content: Any, index: int, role: str) -> str | None:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return None
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad_request(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}.",
                    "messages",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: a text part needs 'text'.",
                                  "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(
        f"messages[{index}].content must be a string or a list of text parts.", "messages"
    )


class _Run:
    """One chat request's engine request, turned into a response or a stream of chunks."""

    def __init__(
        self, context: ServingContext, request: ChatCompletionRequest, engine_request: EngineRequest
    ) -> None:
        self.context = context
        self.request = request
        self.engine_request = engine_request
        self.request_id = engine_request.request_id
        self.created = int(time.time())
        self.usage = PromptUsage(len(engine_request.prompt.prompt_token_ids))
        self.choices = [_Choice() for _ in range(request.n)]
        self.num_top_logprobs = request.top_logprobs or 0

    async def _outputs(self) -> AsyncIterator[CompletionOutput]:
        engine = self.context.async_engine
        async with aclosing(engine.generate([self.engine_request])) as outputs:
            async for output in outputs:
                self.usage.update(output)
                for completion in output.outputs:
                    yield completion

    def _add(self, completion: CompletionOutput) -> list[ChatTokenLogprob] | None:
        """Fold a delta into its choice; returns the delta's logprob entries, if asked for."""
        choice = self.choices[completion.index]
        choice.num_tokens += len(completion.token_ids)
        choice.finish_reason = completion.finish_reason
        choice.stop_reason = completion.stop_reason
        if not self.request.logprobs:
            return None
        entries = _chat_logprobs(completion, self.num_top_logprobs)
        if choice.logprobs is None:
            choice.logprobs = []
        choice.logprobs.extend(entries)
        return entries

    def _usage(self):
        num_completion = sum(c.num_tokens for c in self.choices)
        return make_usage(
            self.usage.num_prompt_tokens, num_completion, self.usage.num_cached_tokens
        )

    async def collect(self) -> ChatCompletionResponse:
        try:
            async for completion in self._outputs():
                self._add(completion)
                self.choices[completion.index].text.append(completion.text)
        except Exception as exc:
            raise engine_error_to_openai(exc) from None
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=[
                ChatCompletionChoice(
                    index=index,
                    message=ChatMessage(role="assistant", content="".join(choice.text)),
                    logprobs=None if choice.logprobs is None else ChatChoiceLogprobs(
                        content=choice.logprobs
                    ),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for index, choice in enumerate(self.choices)
            ],
            usage=self._usage(),
        )

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.context.model_name,
            choices=[choice],
        )

    async def stream(self) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = options is not None and options.include_usage
        exclude = None if include_usage else {"usage"}
        try:
            for index in range(self.request.n):
                role = DeltaMessage(role="assistant", content="")
                yield sse(self._chunk(ChatStreamChoice(index=index, delta=role)), exclude)
            async for completion in self._outputs():
                entries = self._add(completion)
                if (not completion.text and not completion.token_ids
                        and completion.finish_reason is None):
                    continue  # nothing new for the client (text held back at a UTF-8 split)
                choice = ChatStreamChoice(
                    index=completion.index,
                    delta=DeltaMessage(content=completion.text),
                    logprobs=None if entries is None else ChatChoiceLogprobs(content=entries),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield sse(self._chunk(choice), exclude)
            if include_usage:
                yield sse(ChatCompletionChunk(id=self.request_id, created=self.created,
                                              model=self.context.model_name, choices=[],
                                              usage=self._usage()))
        except Exception as exc:
            yield sse(engine_error_body(exc))
        yield SSE_DONE


def _chat_logprobs(completion: CompletionOutput, num_top: int) -> list[ChatTokenLogprob]:
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        sampled = position[token_id]
        token = decoded(sampled.decoded_token)
        top = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        entries.append(
            ChatTokenLogprob(
                token=token,
                logprob=clamp_logprob(sampled.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=decoded(lp.decoded_token),
                        logprob=clamp_logprob(lp.logprob),
                        bytes=list(decoded(lp.decoded_token).encode("utf-8")),
                    )
                    for lp in top
                ],
            )
        )
    return entries
