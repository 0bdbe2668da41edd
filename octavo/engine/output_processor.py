"""OutputProcessor: turns each step's EngineCoreOutputs into the RequestOutputs callers see.

Owns all text: incremental detokenization, stop strings, logprob dicts, and folding the child
requests of an `n > 1` request back into one RequestOutput. Its one backward edge: requests
that hit a stop string are returned as ids the engine must abort in the scheduler.

Must not: touch Request objects, the scheduler or the runner; import torch. It keeps no state
for a request after its final RequestOutput was returned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from octavo.core.outputs import EngineCoreOutput
from octavo.core.request import FinishReason
from octavo.core.sampling_params import RequestOutputKind, SamplingParams
from octavo.engine.detokenizer import Detokenizer, get_backend_tokenizer
from octavo.engine.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    to_prompt_logprobs,
    to_sample_logprobs,
)

# What each RequestOutput carries: vLLM's RequestOutputKind, under the name this package has
# always used for it.
OutputKind = RequestOutputKind


@dataclass(frozen=True, slots=True)
class ProcessedOutputs:
    # PoolingRequestOutput for a pooling request, once, when it ends.
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # Core request ids that hit a stop string this step; the engine aborts them in the
    # scheduler. Their outputs already say FinishReason.STOP.
    reqs_to_abort: list[str]
    # One entry per caller's request that finished (every stream of it): its n, and the most
    # tokens one of its streams got (vllm:request_params_n, request_max_num_generation_tokens).
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _CompletionState:
    """One output stream: a plain request, or one child of an `n > 1` request."""

    index: int
    # The id the scheduler knows (the child id for n > 1), and the id the caller added.
    core_request_id: str
    parent_id: str
    detokenizer: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    # None unless the request asked for logprobs.
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Prefix-cache hits the scheduler reported; -1 until it has.
    num_cached_tokens: int = -1
    # What the caller already holds (DELTA sends from here on).
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    # Got tokens or finished since the last RequestOutput.
    is_changed: bool = False


@dataclass(slots=True)
class _RequestState:
    """What the caller added: a prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    completions: list[_CompletionState]
    num_unfinished: int
    # Asked for: they arrive once (from whichever child is first, for n > 1: each computes
    # the same), and DELTA sends them once.
    prompt_logprobs: PromptLogprobs | None = None
    is_prompt_logprobs_sent: bool = False
    # A pooling request (no text: one PoolingRequestOutput when it ends), and its vector.
    is_pooling: bool = False
    pooled: list[float] | None = None

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a transformers fast tokenizer, or a `tokenizers.Tokenizer`."""
        self._tokenizer = get_backend_tokenizer(tokenizer)
        self._requests: dict[str, _RequestState] = {}
        # Core (child or plain) request id -> its unfinished completion.
        self._completions: dict[str, _CompletionState] = {}
        # Requests finished by abort_requests whose last output the next step reports.
        self._aborted: dict[str, _RequestState] = {}
        # Logprob dicts decode single tokens, over and over; the vocabulary bounds this.
        self._token_texts: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        output_kind: OutputKind,
        child_ids: list[str] | None = None,
        is_pooling: bool = False,
    ) -> None:
        """Registers a request. For n > 1 the engine passes the parent id plus the child request
        ids it created (child i is CompletionOutput index i); engine core outputs arrive under
        the child ids. `is_pooling`: a pooling request, reported once as a
        PoolingRequestOutput when it ends. Raises ValueError on a reused id or a child count
        other than n."""
        core_ids = [request_id] if child_ids is None else list(child_ids)
        if len(core_ids) != sampling_params.n:
            raise ValueError(
                f"child_ids must name sampling_params.n={sampling_params.n} requests, "
                f"got {child_ids!r}."
            )
        for core_id in {request_id, *core_ids}:
            if core_id in self._requests or core_id in self._completions:
                raise ValueError(f"request_id {core_id!r} is already in use.")
        if len(set(core_ids)) != len(core_ids):
            raise ValueError(f"child_ids must be distinct, got {child_ids!r}.")
        wants_logprobs = sampling_params.logprobs is not None
        completions = [
            _CompletionState(
                index=index,
                core_request_id=core_id,
                parent_id=request_id,
                detokenizer=Detokenizer(self._tokenizer, prompt_token_ids, sampling_params),
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs else None,
            )
            for index, core_id in enumerate(core_ids)
        ]
        self._requests[request_id] = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            output_kind,
            completions,
            len(completions),
            is_pooling=is_pooling,
        )
        for completion in completions:
            self._completions[completion.core_request_id] = completion

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """The one loop over a step's outputs. For each EngineCoreOutput:

        1) find its completion; outputs for unknown ids are dropped (the request was aborted,
           or stopped by a stop string and the scheduler has not dropped it yet);
        2) detokenize the new tokens, looking for stop strings, and keep the tokens and
           logprobs up to a stop string;
        3) finish the completion if the scheduler or a stop string ended it; a stop string the
           scheduler does not know about goes to `reqs_to_abort`.
        Then 4) one RequestOutput per request that changed (aborted ones included), in the
        order they first appear, per its OutputKind; a finished request is forgotten.
        """
        changed: dict[str, _RequestState] = self._aborted
        self._aborted = {}
        reqs_to_abort: list[str] = []
        for output in outputs:
            # 1) Find the completion.
            completion = self._completions.get(output.request_id)
            if completion is None:
                continue
            # 2) Text, stop strings, tokens, logprobs.
            stop_string = self._append_output(completion, output)
            # 3) Finish.
            if stop_string is not None:
                completion.finish_reason = FinishReason.STOP
                completion.stop_reason = stop_string
                if output.finish_reason is None:
                    reqs_to_abort.append(output.request_id)
            elif output.finish_reason is not None:
                completion.finish_reason = output.finish_reason
                completion.stop_reason = output.stop_reason
                completion.error = output.error
            request = self._requests[completion.parent_id]
            if output.pooled is not None:
                request.pooled = output.pooled
            if output.prompt_logprobs is not None and request.prompt_logprobs is None:
                request.prompt_logprobs = to_prompt_logprobs(
                    output.prompt_logprobs, self._decode_token
                )
            if completion.finish_reason is not None:
                self._finish_completion(request, completion)
            if completion.is_changed:
                changed.setdefault(request.request_id, request)

        # 4) Build the outputs.
        processed = ProcessedOutputs([], reqs_to_abort)
        for request in changed.values():
            request_output = self._make_request_output(request)
            if request_output is not None:
                processed.request_outputs.append(request_output)
            if request.is_finished:
                del self._requests[request.request_id]
                processed.n_params.append(len(request.completions))
                processed.max_num_generation_tokens.append(
                    max(len(c.token_ids) for c in request.completions)
                )
        return processed

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Finishes requests with FinishReason.ABORT; unknown ids are ignored.

        Takes parent or plain ids (a child id aborts that child only). Returns the core ids the
        scheduler must abort. The final RequestOutputs come from the next `process_outputs`
        call, even one with no outputs; until then the requests count as unfinished.
        """
        core_ids: list[str] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                targets = [c for c in request.completions if c.finish_reason is None]
            elif request_id in self._completions:
                completion = self._completions[request_id]
                request = self._requests[completion.parent_id]
                targets = [completion]
            else:
                continue
            for completion in targets:
                completion.finish_reason = FinishReason.ABORT
                completion.stop_reason = None
                self._finish_completion(request, completion)
                core_ids.append(completion.core_request_id)
            if targets:
                self._aborted[request.request_id] = request
        return core_ids

    def has_request(self, request_id: str) -> bool:
        """Whether the id is in use, as a request's id or one of its children's."""
        return request_id in self._requests or request_id in self._completions

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        """The requests (as added: parents, not children) whose final output is not out."""
        return list(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests as added (an n > 1 request counts once) whose final output is not out."""
        return len(self._requests)

    # ---------------------------------------------------------------------------------------
    # Helpers

    def _append_output(self, completion: _CompletionState, output: EngineCoreOutput) -> str | None:
        """Step 2 for one completion; returns the stop string it hit, if any."""
        # STOP from the scheduler means the last token is EOS or a stop token id.
        stop_terminated = output.finish_reason == FinishReason.STOP
        update = completion.detokenizer.update(output.new_token_ids, stop_terminated)
        num_kept = update.num_kept_tokens
        completion.token_ids.extend(output.new_token_ids[:num_kept])
        if completion.logprobs is not None and output.new_logprobs is not None:
            positions = output.new_logprobs[:num_kept]
            completion.logprobs.extend(to_sample_logprobs(positions, self._decode_token))
            completion.cumulative_logprob += sum(p.logprobs[0] for p in positions)
        completion.num_cached_tokens = output.num_cached_tokens
        if num_kept:
            completion.is_changed = True
        return update.stop_string

    def _finish_completion(self, request: _RequestState, completion: _CompletionState) -> None:
        completion.detokenizer.finish()
        completion.is_changed = True
        del self._completions[completion.core_request_id]
        request.num_unfinished -= 1

    def _make_request_output(
        self, request: _RequestState
    ) -> RequestOutput | PoolingRequestOutput | None:
        if request.is_pooling:
            return _pooling_output(request) if request.is_finished else None
        kind = request.output_kind
        if kind == OutputKind.FINAL_ONLY and not request.is_finished:
            return None
        if kind == OutputKind.DELTA:
            completions = [_take_delta(c) for c in request.completions if c.is_changed]
        else:
            completions = [_take_cumulative(c) for c in request.completions]
        if not completions:
            return None
        reported = [c.num_cached_tokens for c in request.completions if c.num_cached_tokens >= 0]
        prompt_logprobs = request.prompt_logprobs
        if kind == OutputKind.DELTA:
            if request.is_prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                request.is_prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            # For n > 1: the prompt tokens every sample found cached.
            num_cached_tokens=min(reported, default=0),
            prompt_logprobs=prompt_logprobs,
        )

    def _decode_token(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text


def _pooling_output(request: _RequestState) -> PoolingRequestOutput:
    completion = request.completions[0]
    completion.is_changed = False
    return PoolingRequestOutput(
        request_id=request.request_id,
        outputs=PoolingOutput(list(request.pooled or [])),
        prompt_token_ids=request.prompt_token_ids,
        finished=True,
        num_cached_tokens=max(completion.num_cached_tokens, 0),
        prompt=request.prompt,
        finish_reason=completion.finish_reason,
        error=completion.error,
    )


def _take_cumulative(completion: _CompletionState) -> CompletionOutput:
    detokenizer = completion.detokenizer
    completion.num_sent_chars = detokenizer.num_output_chars
    completion.num_sent_tokens = len(completion.token_ids)
    completion.is_changed = False
    return CompletionOutput(
        index=completion.index,
        text=detokenizer.text[: completion.num_sent_chars],
        token_ids=list(completion.token_ids),
        cumulative_logprob=completion.cumulative_logprob,
        logprobs=None if completion.logprobs is None else list(completion.logprobs),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        error=completion.error,
    )


def _take_delta(completion: _CompletionState) -> CompletionOutput:
    detokenizer = completion.detokenizer
    first_char, first_token = completion.num_sent_chars, completion.num_sent_tokens
    completion.num_sent_chars = detokenizer.num_output_chars
    completion.num_sent_tokens = len(completion.token_ids)
    completion.is_changed = False
    return CompletionOutput(
        index=completion.index,
        text=detokenizer.text[first_char : completion.num_sent_chars],
        token_ids=completion.token_ids[first_token:],
        cumulative_logprob=completion.cumulative_logprob,
        logprobs=None if completion.logprobs is None else completion.logprobs[first_token:],
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        error=completion.error,
    )
