"""`POST /v1/completions`: OpenAI's legacy completions, streaming (SSE) or not.

Owns the request -> engine requests mapping (one engine request per prompt; `n` samples per
prompt come back as completion indices, choice index = prompt index * n + sample index) and the
response and chunk shapes, including legacy `logprobs` and `echo`. With both, the prompt's
tokens come first in `logprobs` (vLLM's and OpenAI's form: the first token has no logprob and
no top logprobs), from prompt logprobs the request then asks for (prompt_logprobs=logprobs
unless it sets its own); `text_offset` counts the prompt's token texts, then the completion's.

Must not: step the engine or wait on anything but the AsyncEngine stream; tokenization happens
here (before submitting) so the step loop never waits on it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from octavo.core.sampling_params import BeamSearchParams
from octavo.engine.async_engine import EngineRequest
from octavo.engine.outputs import CompletionOutput, PromptLogprobs
from octavo.entrypoints.server.errors import bad_request
from octavo.entrypoints.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
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
    decoded,
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


@dataclass(slots=True)
class _Choice:
    """One choice's output gathered across steps (non-streaming), or its streaming position."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: CompletionLogprobs | None = None
    # Characters of text (echoed prompt included) before the next token, for text_offset.
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    is_started: bool = False


class OpenAIServingCompletion:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, raw_request: Request) -> Response:
        return await respond(self.context, raw_request, self._prepare)

    async def create_from_body(self, body: bytes) -> CompletionResponse:
        """The response to a JSON body without an HTTP request (`octavo run-batch`); raises
        the OpenAIError the endpoint would answer with."""
        return await collect_body(self.context, self._prepare, body)

    def _prepare(self, body: bytes, arrival_time: float) -> _Run:
        """Everything before the engine runs, in a preparation thread: decode and check the
        body, build the sampling parameters, tokenize every prompt."""
        context = self.context
        request = parse_body(body, CompletionRequest)
        check_model(context, request.model)
        check_priority(context, request.priority)
        _check_unsupported(request)
        prompts = _prompt_list(request.prompt)
        check_num_sequences(context, len(prompts), request.n)
        if request.use_beam_search and request.stream:
            # vLLM's rule (its chat streams a search; see serving_chat).
            raise bad_request("Streaming is not supported with beam search.", "stream")
        check_beam_search_request(context, request)
        limit = generation_max_tokens(context, request.max_tokens)
        max_tokens = request.max_tokens if limit is None else None
        params = make_sampling_params(context, request, max_tokens, request.logprobs, {})
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            # The echoed prompt's logprobs (vLLM's rule): the same count as the completion's.
            params = dataclasses.replace(params, prompt_logprobs=request.logprobs)
        processor = context.async_engine.engine.input_processor
        engine_requests: list[EngineRequest] = []
        request_id = new_request_id("cmpl")
        echoes: list[str] = []
        beams: list[BeamSearchParams] = []
        for index, prompt in enumerate(prompts):
            processed, prompt_params = process_prompt(
                context,
                lambda p=prompt: processor.process_prompt(
                    p, request.add_special_tokens, processor.prompt_limit(params)
                ),
                params,
                {},
                limit,
            )
            engine_requests.append(
                EngineRequest(
                    f"{request_id}-{index}",
                    processed,
                    prompt_params,
                    arrival_time,
                    request.priority,
                )
            )
            if request.use_beam_search:
                beams.append(
                    to_beam_search_params(
                        request,
                        prompt_params,
                        len(processed.prompt_token_ids),
                        context.max_model_len,
                    )
                )
            if request.echo:
                echoes.append(
                    processed.prompt
                    if processed.prompt is not None
                    else context.async_engine.engine.tokenizer.decode(processed.prompt_token_ids)
                )
        return _Run(context, request, request_id, engine_requests, echoes, beams or None)


def _check_unsupported(request: CompletionRequest) -> None:
    if request.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported.", "best_of")
    check_prompt_logprobs(request)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


class _Run:
    """One HTTP request's engine requests, turned into a response or a stream of chunks."""

    def __init__(
        self,
        context: ServingContext,
        request: CompletionRequest,
        request_id: str,
        engine_requests: list[EngineRequest],
        echoes: list[str],
        beams: list[BeamSearchParams] | None = None,
    ) -> None:
        self.context = context
        # Per prompt, its beam search (use_beam_search), or None: the requests run as given.
        self.beams = beams
        self.request = request
        self.request_id = request_id
        self.engine_requests = engine_requests
        self.echoes = echoes
        self.created = int(time.time())
        self.prompt_index = {r.request_id: i for i, r in enumerate(engine_requests)}
        self.usage = [PromptUsage(len(r.prompt.prompt_token_ids)) for r in engine_requests]
        # Per prompt, once they arrive (a DELTA stream sends them in its first output only).
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(engine_requests)
        n = request.n
        self.choices = [_Choice() for _ in range(len(engine_requests) * n)]
        if request.logprobs is not None:
            for choice in self.choices:
                choice.logprobs = CompletionLogprobs()

    async def _outputs(self) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, delta) in the order steps produce them."""
        if self.beams is not None:
            source = beam_search_outputs(
                self.context, self.engine_requests, self.beams, self.request.logprobs
            )
        else:
            source = self.context.async_engine.generate(self.engine_requests)
        async with aclosing(source) as outputs:
            async for output in outputs:
                prompt_index = self.prompt_index[output.request_id]
                self.usage[prompt_index].update(output)
                if output.prompt_logprobs is not None:
                    self.prompt_logprobs[prompt_index] = output.prompt_logprobs
                for completion in output.outputs:
                    yield prompt_index * self.request.n + completion.index, completion

    def _add(self, index: int, completion: CompletionOutput) -> str:
        """Fold a delta into its choice; returns the delta's text (with the echo, if first)."""
        choice = self.choices[index]
        text = completion.text
        if not choice.is_started:
            choice.is_started = True
            if self.echoes:
                prompt_index = index // self.request.n
                text = self.echoes[prompt_index] + text
                choice.offset = len(text) - len(completion.text)
                prompt_logprobs = self.prompt_logprobs[prompt_index]
                if choice.logprobs is not None and prompt_logprobs is not None:
                    choice.offset = _append_prompt_logprobs(
                        self.context,
                        choice.logprobs,
                        self.engine_requests[prompt_index].prompt.prompt_token_ids,
                        prompt_logprobs,
                    )
        choice.num_tokens += len(completion.token_ids)
        if choice.logprobs is not None and completion.logprobs is not None:
            choice.offset = _append_logprobs(
                self.context, choice.logprobs, completion, choice.offset
            )
        choice.finish_reason = completion.finish_reason
        choice.stop_reason = completion.stop_reason
        return text

    def _usage(self):
        return make_usage(
            sum(u.num_prompt_tokens for u in self.usage),
            sum(c.num_tokens for c in self.choices),
            sum(u.num_cached_tokens for u in self.usage),
        )

    async def collect(self) -> CompletionResponse:
        try:
            async for index, completion in self._outputs():
                self.choices[index].text.append(self._add(index, completion))
        except Exception as exc:
            raise engine_error_to_openai(exc) from None
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text="".join(choice.text),
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_logprobs=prompt_logprobs_body(
                        self.prompt_logprobs[index // self.request.n]
                    ),
                )
                for index, choice in enumerate(self.choices)
            ],
            usage=self._usage(),
        )

    async def stream(self) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = self.context.force_include_usage or (
            options is not None and options.include_usage
        )
        exclude = None if include_usage else {"usage"}
        try:
            async for index, completion in self._outputs():
                num_logprobs_before = self._num_logprobs(index)
                text = self._add(index, completion)
                if not text and not completion.token_ids and completion.finish_reason is None:
                    continue  # nothing new for the client (text held back at a UTF-8 split)
                choice = self.choices[index]
                chunk = CompletionChunk(
                    id=self.request_id,
                    created=self.created,
                    model=self.context.model_name,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=_logprobs_since(choice.logprobs, num_logprobs_before),
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                    ],
                )
                yield sse(chunk, exclude)
            if include_usage:
                yield sse(
                    CompletionChunk(
                        id=self.request_id,
                        created=self.created,
                        model=self.context.model_name,
                        choices=[],
                        usage=self._usage(),
                    )
                )
        except Exception as exc:
            yield sse(engine_error_body(exc))
        yield SSE_DONE

    def _num_logprobs(self, index: int) -> int:
        logprobs = self.choices[index].logprobs
        return 0 if logprobs is None else len(logprobs.tokens)


def _append_logprobs(
    context: ServingContext,
    logprobs: CompletionLogprobs,
    completion: CompletionOutput,
    offset: int,
) -> int:
    """Append a delta's positions to `logprobs`; returns the text offset after them (offsets
    count the text's characters, whatever names the tokens)."""
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        sampled = position[token_id]
        logprobs.tokens.append(logprob_token(context, token_id, sampled.decoded_token))
        logprobs.token_logprobs.append(clamp_logprob(sampled.logprob))
        logprobs.text_offset.append(offset)
        offset += len(decoded(sampled.decoded_token))
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        logprobs.top_logprobs.append(
            {
                logprob_token(context, top_id, lp.decoded_token): clamp_logprob(lp.logprob)
                for top_id, lp in ranked
            }
        )
    return offset


def _append_prompt_logprobs(
    context: ServingContext,
    logprobs: CompletionLogprobs,
    prompt_token_ids: list[int],
    prompt_logprobs: PromptLogprobs,
) -> int:
    """Append the echoed prompt's positions to `logprobs` (the first with neither a logprob
    nor top logprobs); returns the text offset after them. Offsets start at 0 and add each
    token's text, as vLLM counts them."""
    offset = 0
    engine = context.async_engine.engine
    for token_id, position in zip(prompt_token_ids, prompt_logprobs, strict=True):
        if position is None:
            text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
            logprobs.tokens.append(logprob_token(context, token_id, text))
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
        else:
            own = position[token_id]
            text = decoded(own.decoded_token)
            logprobs.tokens.append(logprob_token(context, token_id, text))
            logprobs.token_logprobs.append(clamp_logprob(own.logprob))
            logprobs.top_logprobs.append(
                {
                    logprob_token(context, top_id, lp.decoded_token): clamp_logprob(lp.logprob)
                    for top_id, lp in sorted(position.items(), key=lambda item: item[1].rank or 0)
                }
            )
        logprobs.text_offset.append(offset)
        offset += len(text)
    return offset


def _logprobs_since(logprobs: CompletionLogprobs | None, start: int) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    return CompletionLogprobs(
        text_offset=logprobs.text_offset[start:],
        token_logprobs=logprobs.token_logprobs[start:],
        tokens=logprobs.tokens[start:],
        top_logprobs=logprobs.top_logprobs[start:],
    )
