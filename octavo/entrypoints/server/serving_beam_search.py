"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM 0.32 serves it.

Owns the request checks (the fields a beam search does not honour are a 400 naming them, where
vLLM drops them), the request -> BeamSearchParams mapping (`n` is the beam width, vLLM's), and
the asyncio driver of a search: each step submits every live beam as a one-token request to
the AsyncEngine and waits for that step's results only, so the engine goes on stepping every
other request meanwhile; when the search ends, one finished RequestOutput per prompt carries
its best `n` beams as completions 0..n-1 (best first), which the handlers shape like any other.

Must not: step the engine, or tokenize on the event loop (prompts are tokenized by the handler's
preparation; only the few returned beams are decoded here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from octavo.core.request import FinishReason
from octavo.core.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.async_engine import EngineRequest
from octavo.engine.beam_search import (
    BeamSearch,
    BeamSearchSequence,
    check_beam_width,
    step_sampling_params,
)
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.output_processor import OutputKind
from octavo.engine.outputs import CompletionOutput, Logprob, RequestOutput
from octavo.entrypoints.server.errors import bad_request
from octavo.entrypoints.server.protocol import is_off
from octavo.entrypoints.server.serving_common import ServingContext

# Request fields a beam search does not apply, with the values that mean "not set" (None and
# an empty list or object always do). vLLM drops them silently; octavo refuses them.
_NOT_WITH_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "stop": (),
    "stop_token_ids": (),
    "min_tokens": (0,),
    "logit_bias": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "structured_outputs": (),
    "prompt_logprobs": (),
    "spaces_between_special_tokens": (True,),
}


def check_beam_search_request(context: ServingContext, request: Any) -> None:
    """400 naming the field for what a beam search cannot serve: n (the width) beyond what
    --max-logprobs allows, echo with logprobs (vLLM's rule: a beam search computes no prompt
    logprobs), an output constraint, and every sampling field it would not apply. Without
    use_beam_search, only length_penalty is checked: it means nothing then (vLLM drops it)."""
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise bad_request(
                "length_penalty applies only to a beam search (use_beam_search).",
                "length_penalty",
            )
        return
    if getattr(request, "echo", False) and request.logprobs is not None:
        raise bad_request(
            "echo with logprobs is not supported with beam search: a beam search computes no "
            "prompt logprobs.",
            "echo",
        )
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        raise bad_request("response_format is not supported with beam search.", "response_format")
    for name, off in _NOT_WITH_BEAM_SEARCH.items():
        value = getattr(request, name, None)
        if not is_off(value, off) and value != "":
            raise bad_request(f"{name}={value!r} is not supported with beam search.", name)
    try:
        max_logprobs = context.async_engine.engine.input_processor.max_logprobs
        check_beam_width(max_logprobs, request.n, "n")
    except ValueError as exc:
        raise bad_request(str(exc), "n") from None


def to_beam_search_params(
    request: Any, params: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> BeamSearchParams:
    """The search one prompt of the request runs: width n, the prompt's max_tokens (what it
    leaves of max_model_len when the request sets none), and the request's temperature (or
    the default's), ignore_eos, length_penalty and output-text settings (vLLM's mapping)."""
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max(max_model_len - num_prompt_tokens, 1)
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=request.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
    )


async def beam_search_outputs(
    context: ServingContext,
    engine_requests: Sequence[EngineRequest],
    searches: Sequence[BeamSearchParams],
    num_logprobs: int | None,
) -> AsyncIterator[RequestOutput]:
    """Run one search per engine request (its prompt, priority and seed), all at once, and
    yield each one's finished RequestOutput as it ends. Closing the iterator early (a
    disconnect) cancels the searches, which aborts their step's requests within one step."""
    tasks = [
        asyncio.ensure_future(_run_search(context, request, params, num_logprobs))
        for request, params in zip(engine_requests, searches)
    ]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_search(
    context: ServingContext,
    request: EngineRequest,
    params: BeamSearchParams,
    num_logprobs: int | None,
) -> RequestOutput:
    engine = context.async_engine
    prompt = request.prompt
    search = BeamSearch(
        prompt.prompt_token_ids,
        params,
        engine.engine.input_processor.eos_token_ids,
        prompt.prompt,
    )
    step_params = step_sampling_params(params, num_logprobs or 0, request.sampling_params.seed)
    num_cached_tokens = 0
    while not search.is_done():
        steps = [
            EngineRequest(
                f"{request.request_id}-{search.num_steps}-beam-{i}",
                ProcessedPrompt(None, beam.tokens),
                step_params,
                request.arrival_time,
                request.priority,
                OutputKind.FINAL_ONLY,
            )
            for i, beam in enumerate(search.beams)
        ]
        results: dict[str, CompletionOutput] = {}
        async with aclosing(engine.generate(steps)) as outputs:
            async for output in outputs:
                results[output.request_id] = output.outputs[0]
                if search.num_steps == 0:
                    num_cached_tokens = output.num_cached_tokens
        ordered = [results[step.request_id] for step in steps]
        if any(c.finish_reason == FinishReason.ABORT for c in ordered):
            search.abort()
            break
        search.advance([(c.token_ids[0], c.logprobs[0]) for c in ordered])
    completions = [
        _completion(context, index, beam, params, num_logprobs)
        for index, beam in enumerate(search.best())
    ]
    return RequestOutput(
        request.request_id,
        prompt.prompt,
        prompt.prompt_token_ids,
        completions,
        finished=True,
        num_cached_tokens=num_cached_tokens,
    )


def _completion(
    context: ServingContext,
    index: int,
    beam: BeamSearchSequence,
    params: BeamSearchParams,
    num_logprobs: int | None,
) -> CompletionOutput:
    """A returned beam as completion `index` (vLLM's form): its generated tokens (a final EOS
    only with include_stop_str_in_output), their text (never the EOS's), and per position the
    chosen token's logprob plus the top `num_logprobs` when asked for."""
    generated = beam.tokens[beam.num_prompt_tokens :]
    ends_on_eos = beam.finish_reason == FinishReason.STOP
    text_ids = generated[:-1] if ends_on_eos else generated
    token_ids = generated if params.include_stop_str_in_output or not ends_on_eos else text_ids
    text = context.async_engine.engine.tokenizer.decode(
        text_ids, skip_special_tokens=params.skip_special_tokens
    )
    logprobs = None
    if num_logprobs is not None:
        logprobs = [
            _top(position, token_id, num_logprobs)
            for token_id, position in zip(token_ids, beam.logprobs)
        ]
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=beam.cum_logprob,
        logprobs=logprobs,
        finish_reason=beam.finish_reason,
        stop_reason=beam.stop_reason,
    )


def _top(position: dict[int, Logprob], token_id: int, num: int) -> dict[int, Logprob]:
    """The step's logprobs cut to what the request reports: its top `num`, and the token."""
    kept = {t: lp for t, lp in position.items() if lp.rank is not None and lp.rank <= num}
    kept[token_id] = position[token_id]
    return kept
