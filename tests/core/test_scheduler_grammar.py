"""Scheduler with structured-output requests: grammars that are still compiling, masks only
for rows that sample, stops from a complete or rejecting grammar, and preemption.

Every test ends with assert_all_free: all requests finished or aborted, no block leaked.
"""

from __future__ import annotations

from octavo.core.request import FinishReason, Request

from .utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    create_requests,
    create_scheduler,
    ids,
    make_request,
    step,
)


class FakeGrammar:
    """A RequestGrammar that accepts the tokens in `allowed` until it has taken `length` of
    them (then it is complete); records every token it is fed."""

    def __init__(self, length: int = 3, allowed: frozenset[int] = frozenset({7, 8})) -> None:
        self.ready = True
        self.length = length
        self.allowed = allowed
        self.fed: list[int] = []
        self.rejected = False

    def is_ready(self) -> bool:
        return self.ready

    def accept_token(self, token_id: int) -> bool:
        self.fed.append(token_id)
        if token_id not in self.allowed:
            self.rejected = True
        return not self.rejected

    def is_terminated(self) -> bool:
        return self.rejected or len(self.fed) >= self.length

    def error(self) -> str | None:
        return "the fake grammar failed" if self.failed else None

    failed = False


def structured_request(
    request_id: str, prompt: list[int], grammar: FakeGrammar, max_tokens: int = 16, **params: object
) -> Request:
    request = make_request(request_id, prompt, max_tokens, **params)
    request.grammar = grammar
    return request


def test_a_request_whose_grammar_compiles_waits_without_blocking_the_queue() -> None:
    scheduler = create_scheduler()
    compiling = FakeGrammar()
    compiling.ready = False
    a = structured_request("a", [10, 11, 12], compiling)
    b, c = make_request("b", [20, 21]), make_request("c", [30, 31])
    for request in (a, b, c):
        scheduler.add_request(request)

    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"b": 2, "c": 2}
    assert out.structured_output_req_ids == [] and ids(scheduler.waiting) == ["a"]
    # a waits for its grammar, not for room: vLLM's `deferred` reason.
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 1)
    scheduler.check_integrity()

    compiling.ready = True
    assert scheduler.make_stats().num_deferred_reqs == 0
    d = make_request("d", [40])
    scheduler.add_request(d)
    out, _ = step(scheduler)
    # a keeps its place ahead of d; both decodes come first.
    assert out.num_scheduled_tokens == {"b": 1, "c": 1, "a": 3, "d": 1}
    assert out.structured_output_req_ids == ["a"]
    assert_all_free(scheduler)


def test_only_requests_that_sample_are_listed_for_a_mask() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=4)
    grammar = FakeGrammar()
    a = structured_request("a", list(range(100, 106)), grammar)
    scheduler.add_request(a)
    out, core_outputs = step(scheduler)
    # A mid-prompt chunk samples nothing, so it gets no mask and its grammar sees nothing.
    assert out.num_scheduled_tokens == {"a": 4} and out.structured_output_req_ids == []
    assert core_outputs == [] and grammar.fed == []
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 2} and out.structured_output_req_ids == ["a"]
    assert grammar.fed == [7]
    assert_all_free(scheduler)


def test_a_complete_grammar_stops_the_request_at_the_next_token() -> None:
    """The token that completes the grammar is output; the next one (EOS under the mask, here
    with ignore_eos so EOS is no stop token) ends the request as a stop token does."""
    scheduler = create_scheduler()
    grammar = FakeGrammar(length=2)
    a = structured_request("a", [10, 11], grammar, ignore_eos=True, eos_token_id=None)
    scheduler.add_request(a)
    _, (first,) = step(scheduler, {"a": [7]})
    _, (second,) = step(scheduler, {"a": [8]})
    assert (first.finish_reason, second.finish_reason) == (None, None)
    assert grammar.is_terminated()
    _, (last,) = step(scheduler, {"a": [EOS_TOKEN_ID]})
    assert (last.new_token_ids, last.finish_reason, last.stop_reason) == ([2], "stop", None)
    # A complete grammar is not fed again.
    assert grammar.fed == [7, 8] and a.output_token_ids == [7, 8, 2]
    assert_all_free(scheduler)


def test_eos_stops_a_structured_request_before_its_grammar_sees_it() -> None:
    scheduler = create_scheduler()
    grammar = FakeGrammar(length=1)
    scheduler.add_request(structured_request("a", [10, 11], grammar))
    step(scheduler, {"a": [7]})
    _, (last,) = step(scheduler, {"a": [EOS_TOKEN_ID]})
    assert last.finish_reason == "stop" and grammar.fed == [7]
    assert_all_free(scheduler)


def test_a_rejected_token_ends_the_request_with_an_error() -> None:
    """Sampling is masked by the grammar, so a token it rejects is the grammar failing: the
    request must not end as if its output were complete (it used to end with "stop")."""
    scheduler = create_scheduler()
    grammar = FakeGrammar(length=5)
    scheduler.add_request(structured_request("a", [10, 11], grammar))
    step(scheduler, {"a": [7]})
    _, (last,) = step(scheduler, {"a": [99]})
    assert (last.new_token_ids, last.finish_reason) == ([], FinishReason.ERROR)
    assert last.error == "the structured-output grammar rejected token 99"
    assert grammar.fed == [7, 99]
    assert_all_free(scheduler)


def test_a_grammar_that_fails_ends_the_request_with_an_error_not_a_stop() -> None:
    """A grammar in its library's error state also counts as terminated; it must end the
    request as ERROR (a failed constraint used to return an empty answer with "stop")."""
    scheduler = create_scheduler()
    grammar = FakeGrammar(length=5)
    scheduler.add_request(structured_request("a", [10, 11], grammar))
    step(scheduler, {"a": [7]})
    grammar.failed = True
    _, (last,) = step(scheduler, {"a": [8]})
    assert (last.new_token_ids, last.finish_reason) == ([], FinishReason.ERROR)
    assert last.error == "the fake grammar failed" and grammar.fed == [7]
    assert_all_free(scheduler)


def test_max_tokens_still_caps_a_structured_request() -> None:
    scheduler = create_scheduler()
    grammar = FakeGrammar(length=10)
    scheduler.add_request(structured_request("a", [10, 11], grammar, max_tokens=2))
    step(scheduler, {"a": [7]})
    _, (last,) = step(scheduler, {"a": [8]})
    assert last.finish_reason == "length" and grammar.fed == [7, 8]
    assert_all_free(scheduler)


def test_preemption_does_not_feed_the_grammar_twice() -> None:
    """Regression guard: a resumed request recomputes its output tokens as prompt; feeding
    them to its grammar again would desynchronise it from the text."""
    scheduler = create_scheduler()
    a, b = create_requests(2, num_tokens=[16, 20])
    grammar = FakeGrammar(length=10)
    b.grammar = grammar
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, {"0": [50], "1": [7]})
    # a's position 16 takes the last free block; b's position 20 finds none, so b (newest) is
    # preempted. On resume its prompt blocks are prefix hits and its output token 7 is
    # recomputed as input, not sampled.
    out, _ = step(scheduler, {"0": [51]})
    assert out.preempted_req_ids == {"1"} and grammar.fed == [7]
    scheduler.abort_requests(["0"])
    out, _ = step(scheduler, {"1": [8]})
    assert out.scheduled_new_reqs[0].output_token_ids == [7]
    assert out.num_scheduled_tokens == {"1": 1} and out.structured_output_req_ids == ["1"]
    assert grammar.fed == [7, 8] and b.output_token_ids == [7, 8]
    assert_all_free(scheduler)
