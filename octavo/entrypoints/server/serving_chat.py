"""`POST /v1/chat/completions`: chat messages rendered by the model's template, streaming or not,
with tool calls and the model's thinking.

Owns the chat response and chunk shapes (a role delta opens each choice's stream; tool calls
stream as OpenAI's deltas: index, id and name first, then argument fragments), chat
`logprobs`, and the use of one reasoning parser and one tool parser per choice: the thinking
goes out as `reasoning` (its own deltas when streaming), and only the answer after it reaches
the tool parser. `finish_reason` is "tool_calls" when a choice that stopped naturally made
calls. Message checking and rendering live in chat_render.py, tools and tool_choice in
tool_parsers/, the thinking's tags in reasoning_parsers.py.

Must not: step the engine; rendering and tokenization happen here, before submitting, and are
moved to a worker thread when the conversation is large.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from octavo.core.request import FinishReason
from octavo.core.sampling_params import BeamSearchParams
from octavo.engine.async_engine import EngineRequest
from octavo.engine.outputs import CompletionOutput, PromptLogprobs
from octavo.entrypoints.server.chat_render import chat_render_from, with_reasoning_effort
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from octavo.entrypoints.server.reasoning_parsers import ReasoningParser, reasoning_parser_for
from octavo.entrypoints.server.request_body import parse_body
from octavo.entrypoints.server.serving_beam_search import (
    beam_search_outputs,
    check_beam_search_request,
    to_beam_search_params,
)
from octavo.entrypoints.server.serving_common import (
    SSE_DONE,
    PromptUsage,
    ServingContext,
    check_model,
    check_num_sequences,
    check_priority,
    check_prompt_logprobs,
    clamp_logprob,
    collect_body,
    engine_error_body,
    engine_error_to_openai,
    generation_max_tokens,
    logprob_token,
    make_sampling_params,
    make_usage,
    new_request_id,
    process_prompt,
    prompt_logprobs_body,
    respond,
    sse,
)
from octavo.entrypoints.server.tool_parsers import ToolCallDelta, ToolParser
from octavo.entrypoints.server.tool_parsers.tool_choice import ToolServing, resolve_tools


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatTokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Reads tool calls out of this choice's text; None: the text is all content.
    parser: ToolParser | None = None
    # Splits the thinking from the answer; None: the text is all answer.
    reasoning: ReasoningParser | None = None
    # Whether a tool call has been streamed for this choice.
    called: bool = False
    # parallel_tool_calls false: the first tool call only.
    first_call_only: bool = False
    # A second reading of the thinking, delta by delta, that counts the output tokens whose
    # text is thinking (usage's reasoning_tokens in /v1/responses); None: no thinking.
    counter: ReasoningParser | None = None
    num_reasoning_tokens: int = 0


class OpenAIServingChat:
    def __init__(
        self,
        context: ServingContext,
        tools: ToolServing | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.context = context
        self.tools = tools or ToolServing()
        # --reasoning-parser (checked at start-up, ServerConfig).
        self.reasoning_parser = reasoning_parser

    async def create(self, raw_request: Request) -> Response:
        return await respond(self.context, raw_request, self._prepare)

    async def create_from_body(self, body: bytes) -> ChatCompletionResponse:
        """The response to a JSON body without an HTTP request (`octavo run-batch`); raises
        the OpenAIError the endpoint would answer with."""
        return await collect_body(self.context, self._prepare, body)

    def _prepare(self, body: bytes, arrival_time: float) -> _Run:
        return self.prepare_request(parse_body(body, ChatCompletionRequest), arrival_time)

    def prepare_request(self, request: ChatCompletionRequest, arrival_time: float) -> _Run:
        """Everything before the engine runs, in a preparation thread: check the request and
        its tools, build the sampling parameters (compiling any constraint), render the
        conversation and tokenize it. /v1/responses and /v1/messages translate their bodies
        into a chat request and come here too, so that all three render, sample and parse
        alike. Raises OpenAIError naming the chat field at fault."""
        context = self.context
        check_model(context, request.model)
        check_priority(context, request.priority)
        check_num_sequences(context, 1, request.n)
        # vLLM streams a chat beam search: each beam's whole text as one delta at the end.
        check_beam_search_request(context, request)
        if request.stream_options is not None and not request.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true.", "stream_options"
            )
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        check_prompt_logprobs(request)
        tool_setup = resolve_tools(request.tools, request.tool_choice, self.tools)
        if request.use_beam_search and tool_setup.structured_outputs is not None:
            raise bad_request(
                f"tool_choice={request.tool_choice!r} constrains the output, which is not "
                "supported with beam search.",
                "tool_choice",
            )
        defaults = context.default_chat_template_kwargs or {}
        template_kwargs = with_reasoning_effort(
            {**defaults, **(request.chat_template_kwargs or {})}, request.reasoning_effort
        )
        make_reasoning = reasoning_parser_for(self.reasoning_parser, template_kwargs)
        processor = context.async_engine.engine.input_processor
        if make_reasoning is not None and not _constraints_wait_for_the_answer(processor):
            _check_unconstrained(request, tool_setup.structured_outputs is not None)
        render = chat_render_from(request, tool_setup.tools, context)
        rename = {"logprobs": "top_logprobs", "prompt": "messages"}
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            rename["max_tokens"] = "max_completion_tokens"
        limit = generation_max_tokens(context, max_tokens)
        if limit is not None:
            max_tokens = None  # the limit decides, cut to the prompt's room by process_prompt
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = make_sampling_params(context, request, max_tokens, logprobs, rename)
        if tool_setup.keeps_special_tokens:
            params.skip_special_tokens = False  # the parser needs its markers (vLLM's rule)
        if tool_setup.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    'tool_choice "required" or a named function cannot be combined with '
                    "another output constraint (response_format, structured_outputs).",
                    "tool_choice",
                )
            params.structured_outputs = tool_setup.structured_outputs
            rename["structured_outputs"] = "tools"  # a tool schema the grammar cannot take
        processed, params = process_prompt(
            context,
            lambda: render(processor, processor.prompt_limit(params)),
            params,
            rename,
            limit,
        )
        request_id = new_request_id("chatcmpl")
        engine_request = EngineRequest(
            request_id, processed, params, arrival_time, request.priority
        )
        run = _Run(context, request, engine_request, tool_setup.make_parser, make_reasoning)
        if request.use_beam_search:
            num_prompt_tokens = len(processed.prompt_token_ids)
            run.beam = to_beam_search_params(
                request, params, num_prompt_tokens, context.max_model_len
            )
        return run


class _Run:
    """One chat request's engine request, turned into a response or a stream of chunks."""

    def __init__(
        self,
        context: ServingContext,
        request: ChatCompletionRequest,
        engine_request: EngineRequest,
        make_parser: Callable[[], ToolParser] | None,
        make_reasoning: Callable[[], ReasoningParser] | None = None,
    ) -> None:
        self.context = context
        self.request = request
        self.engine_request = engine_request
        self.engine_requests = [engine_request]
        self.request_id = engine_request.request_id
        self.created = int(time.time())
        self.usage = PromptUsage(len(engine_request.prompt.prompt_token_ids))
        self.choices = [
            _Choice(
                parser=None if make_parser is None else make_parser(),
                reasoning=None if make_reasoning is None else make_reasoning(),
                counter=None if make_reasoning is None else make_reasoning(),
                first_call_only=request.parallel_tool_calls is False,
            )
            for _ in range(request.n)
        ]
        self.num_top_logprobs = request.top_logprobs or 0
        self.prompt_logprobs: PromptLogprobs | None = None
        # Its beam search (use_beam_search), or None: the request runs as given.
        self.beam: BeamSearchParams | None = None

    async def _outputs(self) -> AsyncIterator[CompletionOutput]:
        if self.beam is not None:
            num_logprobs = self.num_top_logprobs if self.request.logprobs else None
            source = beam_search_outputs(
                self.context, self.engine_requests, [self.beam], num_logprobs
            )
        else:
            source = self.context.async_engine.generate(self.engine_requests)
        async with aclosing(source) as outputs:
            async for output in outputs:
                self.usage.update(output)
                if output.prompt_logprobs is not None:
                    self.prompt_logprobs = output.prompt_logprobs
                for completion in output.outputs:
                    yield completion

    def _add(self, completion: CompletionOutput) -> list[ChatTokenLogprob] | None:
        """Fold a delta into its choice; returns the delta's logprob entries, if asked for."""
        choice = self.choices[completion.index]
        choice.num_tokens += len(completion.token_ids)
        choice.finish_reason = completion.finish_reason
        choice.stop_reason = completion.stop_reason
        if choice.counter is not None and choice.counter.feed(completion.text).reasoning:
            choice.num_reasoning_tokens += len(completion.token_ids)
        if not self.request.logprobs:
            return None
        entries = _chat_logprobs(self.context, completion, self.num_top_logprobs)
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
        choices = []
        for index, choice in enumerate(self.choices):
            message, finish_reason = _final_message(choice, self.context.response_role)
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=message,
                    logprobs=None
                    if choice.logprobs is None
                    else ChatChoiceLogprobs(content=choice.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=choices,
            usage=self._usage(),
            prompt_logprobs=prompt_logprobs_body(self.prompt_logprobs),
        )

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=[choice],
        )

    def include_usage(self) -> bool:
        options = self.request.stream_options
        return self.context.force_include_usage or (options is not None and options.include_usage)

    async def stream(self) -> AsyncIterator[str]:
        exclude = None if self.include_usage() else {"usage"}
        try:
            async with aclosing(self.chunks()) as chunks:
                async for chunk in chunks:
                    yield sse(chunk, None if chunk.usage is not None else exclude)
        except Exception as exc:
            yield sse(engine_error_body(exc))
        yield SSE_DONE

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks in order, the usage chunk last when asked for; a failure of
        the engine is raised (the caller frames it for its own wire format). Closing it (a
        client gone; callers use aclosing) aborts the request within a step."""
        opened = False
        async for completion in self._outputs():
            if not opened:
                # Each choice's role delta goes out with the first output (the first token),
                # as vLLM sends it, so that a client's time to first chunk is the time to
                # the first token.
                opened = True
                for index in range(self.request.n):
                    role = DeltaMessage(role=self.context.response_role, content="")
                    yield self._chunk(ChatStreamChoice(index=index, delta=role))
            entries = self._add(completion)
            choice = self.choices[completion.index]
            delta = _stream_delta(choice, completion)
            finish_reason = completion.finish_reason
            if choice.parser is not None:
                finish_reason = _tool_finish_reason(finish_reason, choice.called)
            if delta is None:
                if finish_reason is None and not entries:
                    continue  # nothing new for the client (text held back)
                delta = DeltaMessage()
            yield self._chunk(
                ChatStreamChoice(
                    index=completion.index,
                    delta=delta,
                    logprobs=None if entries is None else ChatChoiceLogprobs(content=entries),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        if self.include_usage():
            yield ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.context.model_name,
                choices=[],
                usage=self._usage(),
            )

    @property
    def num_prompt_tokens(self) -> int:
        return self.usage.num_prompt_tokens

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(choice.num_reasoning_tokens for choice in self.choices)


def _constraints_wait_for_the_answer(processor: Any) -> bool:
    """Whether the engine holds output constraints back until the thinking ends: it does when
    the model's tokenizer has the reasoning parser's markers as tokens (a reasoning gate)."""
    structured = getattr(processor, "structured_output", None)
    return getattr(structured, "reasoning_gate", None) is not None


def _check_unconstrained(request: ChatCompletionRequest, by_tool_choice: bool) -> None:
    """For a request whose output is read as thinking and answer, on a model whose tokenizer
    has no single-token thinking markers: the engine cannot tell where the thinking ends, so
    a constraint would hold from the first token on, thinking included. A 400 naming the
    field, never a silently wrong split. Checked before the constraint is compiled."""
    if by_tool_choice:
        param = "tool_choice"
    elif request.response_format is not None and request.response_format.type != "text":
        param = "response_format"
    elif request.structured_outputs is not None:
        param = "structured_outputs"
    else:
        return
    raise bad_request(
        f"{param} constrains the output, which this server (--reasoning-parser) reads as "
        "thinking and answer, and this model's tokenizer has no <think> and </think> tokens "
        "to tell where the thinking ends; a constraint over the thinking is not supported. "
        "Turn the thinking off (for qwen3: chat_template_kwargs enable_thinking false) or drop "
        "the constraint.",
        param,
    )


def _tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    # A choice that stopped on its own after calling tools is waiting for their results.
    return "tool_calls" if called and finish_reason == FinishReason.STOP else finish_reason


def _final_message(choice: _Choice, role: str = "assistant") -> tuple[ChatMessage, str | None]:
    text: str | None = "".join(choice.text)
    reasoning = None
    if choice.reasoning is not None:
        reasoning, text = choice.reasoning.extract(text or "")
    if choice.parser is None:
        return ChatMessage(role=role, reasoning=reasoning, content=text), choice.finish_reason
    extracted = choice.parser.extract(text or "")
    calls = [
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in extracted.tool_calls[: 1 if choice.first_call_only else None]
    ]
    message = ChatMessage(
        role=role, reasoning=reasoning, content=extracted.content, tool_calls=calls or None
    )
    return message, _tool_finish_reason(choice.finish_reason, bool(calls))


def _stream_delta(choice: _Choice, completion: CompletionOutput) -> DeltaMessage | None:
    """What this output delta shows the client; None when there is nothing to show."""
    finished = completion.finish_reason is not None
    if choice.parser is None and choice.reasoning is None:
        if not completion.text and not completion.token_ids and not finished:
            return None
        return DeltaMessage(content=completion.text)
    text, reasoning = completion.text, ""
    if choice.reasoning is not None:
        split = choice.reasoning.feed(text)
        if finished:
            split.extend(choice.reasoning.finish())
        text, reasoning = split.content, split.reasoning
    if choice.parser is None:
        if not text and not reasoning:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=text or None)
    update = choice.parser.feed(text)
    if finished:
        update.extend(choice.parser.finish())
    if choice.first_call_only:
        update.tool_calls = [call for call in update.tool_calls if call.index == 0]
    if not update.content and not update.tool_calls and not reasoning:
        return None
    choice.called = choice.called or bool(update.tool_calls)
    return DeltaMessage(
        reasoning=reasoning or None,
        content=update.content or None,
        tool_calls=_delta_tool_calls(update.tool_calls) or None,
    )


def _delta_tool_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """Parser deltas -> OpenAI's; consecutive pieces of one call travel as one entry."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments = (last.arguments or "") + (delta.arguments or "")
        else:
            merged.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
    return [
        DeltaToolCall(
            index=delta.index,
            id=delta.id,
            type="function" if delta.id is not None else None,
            function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments),
        )
        for delta in merged
    ]


def _chat_logprobs(
    context: ServingContext, completion: CompletionOutput, num_top: int
) -> list[ChatTokenLogprob]:
    """A delta's positions as chat logprobs; `bytes` are those of the token's name (its text,
    or `token_id:ID`), as vLLM gives them."""
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        sampled = position[token_id]
        token = logprob_token(context, token_id, sampled.decoded_token)
        top = sorted(
            (
                (top_id, lp)
                for top_id, lp in position.items()
                if lp.rank is not None and lp.rank <= num_top
            ),
            # Tied logprobs share a rank: the sampled token first among its equals, and never
            # more than top_logprobs entries (OpenAI's and vLLM's count).
            key=lambda item: (item[1].rank, item[0] != token_id),
        )[:num_top]
        entries.append(
            ChatTokenLogprob(
                token=token,
                logprob=clamp_logprob(sampled.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=(top_token := logprob_token(context, top_id, lp.decoded_token)),
                        logprob=clamp_logprob(lp.logprob),
                        bytes=list(top_token.encode("utf-8")),
                    )
                    for top_id, lp in top
                ],
            )
        )
    return entries
