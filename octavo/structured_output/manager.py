"""StructuredOutputManager: compiles grammars off the step loop, caches them, fills masks.

The engine's one handle on structured outputs:
1) `validate(params)` before admission (the caller's thread, never the event loop's): the
   grammar is compiled there and refused (ValueError naming `structured_outputs`) when it is
   invalid or cannot be followed (no output satisfies it, or the library gives up on it), so
   a constraint is either followed or the request is refused before it is queued.
2) `grammar_for(params, prompt_token_ids)` at admission (engine thread): a per-request
   GuidanceGrammar over the compilation validate() made, or, for params that skipped it, one
   run in a background thread; requests with the same `params.key` share one compilation (an
   LRU cache of `max_cached_grammars` entries). Under a reasoning parser it is gated until the
   thinking ends (structured_output/reasoning.py).
3) `grammar_bitmask(grammars, drafts)` each step (engine thread): one int32 token-mask row per
   structured request that samples this step, and one more per token it proposed
   (speculative decoding: the mask after each proposed token).

The llguidance tokenizer is built on first use, so an engine that never sees a structured
request never pays for it. Must not: know about scheduling (the scheduler decides who waits
and who samples) or torch (the runner applies the mask).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import numpy as np
from transformers import PreTrainedTokenizerBase

from octavo.core.request import RequestGrammar
from octavo.core.sampling_params import StructuredOutputsParams
from octavo.structured_output.backend import GuidanceBackend
from octavo.structured_output.grammar import GuidanceGrammar
from octavo.structured_output.reasoning import ReasoningGate, ThinkingGatedGrammar

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept; most deployments reuse a handful of schemas.
DEFAULT_MAX_CACHED_GRAMMARS = 256
# Compilation is mostly native code that drops the GIL; two threads keep one slow grammar
# from delaying every other new schema without competing much with the step loop.
_NUM_COMPILE_THREADS = 2


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_cached_grammars: int = DEFAULT_MAX_CACHED_GRAMMARS,
        reasoning_parser: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # With a reasoning parser whose markers are tokens: constraints wait for the thinking
        # to end (grammar_for's prompt_token_ids). None: no parser, or it cannot be done.
        self.reasoning_gate = ReasoningGate.for_tokenizer(reasoning_parser, tokenizer)
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self.max_cached_grammars = max_cached_grammars
        # Guards the lazy backend, the caches and the pending set: validate() runs on the
        # server's worker threads while grammar_for() runs on the engine thread.
        self._lock = threading.Lock()
        self._backend: GuidanceBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()
        # Grammar specs that passed validation, by key: a repeated schema skips the check.
        self._validated: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._pending: set[Future[llguidance.LLMatcher]] = set()
        # Counters for benchmarks and tests: compilations started, and the step-loop time
        # spent filling masks.
        self.num_compiles = 0
        self.bitmask_seconds = 0.0

    @property
    def backend(self) -> GuidanceBackend:
        with self._lock:
            if self._backend is None:
                self._backend = GuidanceBackend(
                    self._tokenizer, self._vocab_size, self._eos_token_ids
                )
            return self._backend

    # --- before admission -------------------------------------------------------------------

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming `structured_outputs.<kind>` if `params` cannot be compiled
        or followed. Compiles (milliseconds, up to seconds for a large grammar) and keeps the
        result for grammar_for; a key compiled before is not compiled again."""
        key = _cache_key(params)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return
        spec = self._validated_spec(params)
        matcher = self.backend.compile_checked(params, spec)
        compiled: Future[llguidance.LLMatcher] = Future()
        compiled.set_result(matcher)
        with self._lock:
            self.num_compiles += 1
            self._remember(key, compiled)

    def _validated_spec(self, params: StructuredOutputsParams) -> str:
        key = _cache_key(params)
        with self._lock:
            spec = self._validated.get(key)
            if spec is not None:
                self._validated.move_to_end(key)
                return spec
        spec = self.backend.validate(params)
        with self._lock:
            self._validated[key] = spec
            while len(self._validated) > self.max_cached_grammars:
                self._validated.popitem(last=False)
        return spec

    # --- admission --------------------------------------------------------------------------

    def grammar_for(
        self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()
    ) -> GuidanceGrammar | ThinkingGatedGrammar:
        """A new request's grammar: not ready until its compilation (shared by every request
        with the same key, and cached) has finished in the background. With a reasoning gate
        and a prompt that leaves the model thinking, it holds from the end of the thinking."""
        grammar = self._grammar_for(params)
        gate = self.reasoning_gate
        if gate is not None and gate.is_thinking_after(prompt_token_ids):
            return gate.gate(grammar)
        return grammar

    def _grammar_for(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        key = _cache_key(params)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return GuidanceGrammar(compiled)
        spec = self._validated_spec(params)
        backend = self.backend
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    _NUM_COMPILE_THREADS, thread_name_prefix="octavo-grammar"
                )
            compiled = self._executor.submit(backend.compile, spec)
            self.num_compiles += 1
            self._pending.add(compiled)
            self._remember(key, compiled)
        compiled.add_done_callback(self._discard_pending)
        return GuidanceGrammar(compiled)

    def _remember(self, key: tuple[str, str], compiled: Future[llguidance.LLMatcher]) -> None:
        """Cache a compilation (the lock held); requests holding an evicted one keep their
        future, only sharing ends."""
        self._compiled[key] = compiled
        while len(self._compiled) > self.max_cached_grammars:
            self._compiled.popitem(last=False)

    def _discard_pending(self, compiled: Future[llguidance.LLMatcher]) -> None:
        with self._lock:
            self._pending.discard(compiled)

    def wait_for_pending(self, timeout_s: float) -> None:
        """Block until a compilation finishes, at most `timeout_s`; returns at once when none
        is running. For a step loop with nothing else to do, instead of spinning."""
        with self._lock:
            pending = set(self._pending)
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # --- each step --------------------------------------------------------------------------

    def grammar_bitmask(
        self,
        grammars: Sequence[RequestGrammar],
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> np.ndarray:
        """(sum of 1 + len(drafts[i]), ceil(vocab / 32)) int32: grammar i's rows in order,
        the tokens it allows next, then after each of its proposed tokens in turn (drafts:
        each grammar's speculative proposal, tokens it accepts; none by default). Every
        grammar must be ready (the scheduler admits only those); none changes state."""
        start = time.perf_counter()
        drafts = drafts if drafts is not None else [()] * len(grammars)
        items = []
        thinking_rows: list[int] = []
        row = 0
        for grammar, draft in zip(grammars, drafts, strict=True):
            num_rows = 1 + len(draft)
            if isinstance(grammar, ThinkingGatedGrammar):
                if grammar.thinking:
                    # The proposal stops short of the end of the thinking (num_valid): all
                    # its rows allow every token.
                    thinking_rows.extend(range(row, row + num_rows))
                    draft = ()
                grammar = grammar.grammar  # its matcher fills the row, allowed or not
            if not isinstance(grammar, GuidanceGrammar):
                raise TypeError(f"not a grammar of this manager: {grammar!r}")
            items.append((grammar.matcher, row, list(draft)))
            row += num_rows
        bitmask = self.backend.fill_bitmask(items, row)
        bitmask[thinking_rows] = -1  # every token allowed while the model thinks
        self.bitmask_seconds += time.perf_counter() - start
        return bitmask

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """`params.key`, with a schema given as JSON text canonicalised like a dict schema, so
    that a client sending the same schema either way (or reordered) compiles it once."""
    if params.kind == "json" and isinstance(params.json, str):
        try:
            schema = json.loads(params.json)
        except ValueError:
            return params.key  # validation reports it
        return ("json", json.dumps(schema, sort_keys=True, separators=(",", ":")))
    return params.key
