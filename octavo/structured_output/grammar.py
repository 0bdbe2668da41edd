"""GuidanceGrammar: one request's grammar state, the core `RequestGrammar` over llguidance.

Owns the request's own matcher, a deep copy of the compiled (cached, shared) one taken the
first time the grammar is found ready. Every n > 1 child has its own GuidanceGrammar, so the
children advance independently from one compilation.

Must not: compile (the manager's thread pool does) or be used from two threads at once (the
engine thread alone calls it: the scheduler to advance it, the manager to read its mask).
"""

from __future__ import annotations

from concurrent.futures import Future

import llguidance


class GuidanceGrammar:
    """Implements octavo.core.request.RequestGrammar."""

    __slots__ = ("_compiled", "_matcher")

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None

    def is_ready(self) -> bool:
        if self._matcher is not None:
            return True
        if not self._compiled.done():
            return False
        # compile() never raises: a failure is a matcher in its error state.
        self._matcher = self._compiled.result().deep_copy()
        return True

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if not self.is_ready():
            raise RuntimeError("the grammar is still compiling")
        assert self._matcher is not None
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def is_terminated(self) -> bool:
        # Stopped: the grammar is complete (only EOS may follow) or in its error state.
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        matcher = self.matcher
        if not matcher.is_error():
            return None
        return f"the structured-output grammar failed: {matcher.get_error().splitlines()[0]}"
