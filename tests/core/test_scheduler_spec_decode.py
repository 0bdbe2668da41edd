"""Speculative decoding in the scheduler, without a model: proposals scheduled as 1 + k tokens
within the budget and max_tokens, rejected ones rolled back, the KV written for rejected
proposals never read or served by the prefix cache, every block back in the pool, and the
tokens the same as without speculation."""

from __future__ import annotations

import dataclasses
import random

import pytest

from octavo.config import CacheConfig, SchedulerConfig, resolve_speculative_config
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.core.scheduler_output import SchedulerOutput
from octavo.core.spec_decode import SuffixProposer, find_continuation

from .utils import assert_all_free, create_scheduler, make_request


def _spec_scheduler(
    method: str = "ngram",
    num_speculative_tokens: int = 3,
    num_blocks: int = 10,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    **spec: object,
) -> Scheduler:
    """create_scheduler's scheduler with proposals (prompt lookup of 1- to 3-grams; a draft
    model's, which the test plays, under draft_model)."""
    if method == "draft_model":
        spec = {"model": "draft", **spec}
    config = resolve_speculative_config(
        {
            "method": method,
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            **spec,
        }
    )
    return Scheduler(
        SchedulerConfig(16, max_num_batched_tokens, max_model_len),
        CacheConfig(block_size, num_blocks, True),
        speculative_config=config,
    )


# --- proposers ---------------------------------------------------------------------------------


def test_find_continuation_takes_the_longest_latest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # "2 3" occurs at 1 and 5; "7 2 3" nowhere earlier: the 2-gram's latest place wins.
    assert find_continuation(tokens, 1, 3, 3) == (2, [4, 5, 7])
    assert find_continuation(tokens, 3, 3, 3) == (0, [])
    # Large token ids (several bytes each) never match across token boundaries.
    big = [0x01020304, 0x05060708, 0x0102, 0x03040506, 0x0708]
    assert find_continuation(big + [0x0304], 1, 1, 2) == (0, [])
    assert find_continuation([5, 6, 5], 1, 2, 4) == (1, [6, 5])


def test_suffix_proposer_finds_an_earlier_requests_output_and_evicts() -> None:
    config = resolve_speculative_config(
        {
            "method": "suffix",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "suffix_decoding_max_cached_requests": 2,
        }
    )
    proposer = SuffixProposer(config)
    done = make_request("a", [1, 2])
    done.append_output_token_ids([10, 11, 12, 13, 14, 15])
    proposer.finish(done)
    asking = make_request("b", [9, 9, 11, 12])
    assert proposer.propose(asking, 4) == [13, 14]  # a 2-token match proposes at most 2
    asking.append_output_token_ids([13])
    assert proposer.propose(asking, 4) == [14, 15]
    for i in range(2):  # two more outputs evict the first
        other = make_request(f"c{i}", [1])
        other.append_output_token_ids([30 + i, 31, 32, 33])
        proposer.finish(other)
    assert proposer.propose(asking, 4) == []
    assert len(proposer.outputs) == 2 and proposer.num_cached_tokens == 8
    assert all(
        seq_id in proposer.by_id for places in proposer.index.values() for seq_id, _ in places
    )


def test_a_match_as_long_as_the_depth_still_proposes() -> None:
    """A request copying its prompt: once the copy is longer than the depth, the match counts
    only as much of it as leaves the proposal its room (depth 8, 4 tokens: 4 of the match)."""
    config = resolve_speculative_config(
        {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
    )
    proposer = SuffixProposer(config)
    prompt = list(range(100, 140))
    copying = make_request("r", [*prompt, 1])
    copying.append_output_token_ids(prompt[:20])  # a 20-token match
    assert proposer.propose(copying, 4) == prompt[20:24]
    copying.append_output_token_ids(prompt[20:22])
    assert proposer.propose(copying, 4) == prompt[22:26]
    short = make_request("s", [*prompt, 1])
    short.append_output_token_ids(prompt[:3])  # a 3-token match proposes at most 3
    assert proposer.propose(short, 4) == prompt[3:6]


# --- scheduling and rollback -------------------------------------------------------------------


def _runner_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]
) -> ModelRunnerOutput:
    """The given tokens for each request whose step ends at its last known token (or after
    its proposals); none for a prompt chunk that is not the last."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    tokens = [
        sampled.get(r, [])
        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
        else []
        for r in req_ids
    ]
    return ModelRunnerOutput(req_ids, tokens, [None] * len(req_ids))


def test_proposals_scheduled_and_rejected_ones_rolled_back() -> None:
    scheduler = _spec_scheduler(num_blocks=10, block_size=4)
    # The prompt repeats "5 6 7 8": after the first token 5 the lookup proposes 6 7 8.
    scheduler.add_request(make_request("r", [5, 6, 7, 8, 1, 5, 6, 7, 8, 1], max_tokens=10))
    out = scheduler.schedule()
    scheduler.update(out, _runner_output(scheduler, out, {"r": [5]}))
    request = scheduler.requests["r"]
    assert request.spec_token_ids == [6, 7, 8]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_spec_decode_tokens == {"r": [6, 7, 8]}
    assert request.num_computed_tokens == 14  # 10 + 1 + 3, before the rollback
    # 6 accepted, 7 rejected (the model said 9): two tokens appended, two positions undone.
    scheduler.update(out, _runner_output(scheduler, out, {"r": [6, 9]}))
    assert request.output_token_ids == [5, 6, 9]
    assert request.num_computed_tokens == 12
    assert request.num_tokens == 13
    stats = scheduler.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == (1, 0, 0)
    # Only known tokens were ever hashed: 3 full blocks of 4 among 13 tokens.
    assert len(request.block_hashes) == 3
    assert_all_free(scheduler)


def test_proposals_within_budget_and_max_tokens() -> None:
    scheduler = _spec_scheduler(num_speculative_tokens=5, max_num_batched_tokens=3)
    scheduler.add_request(make_request("r", [3, 4, 3, 4, 3, 4, 3], max_tokens=3))
    out = scheduler.schedule()  # the prompt in chunks of 3
    while not scheduler.requests["r"].output_token_ids:
        scheduler.update(out, _runner_output(scheduler, out, {"r": [4]}))
        out = scheduler.schedule()
    request = scheduler.requests["r"]
    # max_tokens 3 with one token out: room for 2 more, so one proposal at most.
    assert out.scheduled_spec_decode_tokens == {"r": [3]}
    assert out.num_scheduled_tokens == {"r": 2}
    outputs = scheduler.update(out, _runner_output(scheduler, out, {"r": [3, 4]}))
    assert request.output_token_ids == [4, 3, 4] and outputs[0].finish_reason == "length"
    assert_all_free(scheduler)


def test_budget_cuts_a_proposal() -> None:
    scheduler = _spec_scheduler(num_speculative_tokens=4, max_num_batched_tokens=3)
    scheduler.add_request(make_request("r", [4, 5, 6], max_tokens=16))
    out = scheduler.schedule()
    scheduler.update(out, _runner_output(scheduler, out, {"r": [4]}))
    request = scheduler.requests["r"]
    assert request.spec_token_ids == [5, 6, 4]
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [5, 6]}
    assert out.num_scheduled_tokens == {"r": 3}
    # Both accepted, and the token after them.
    scheduler.update(out, _runner_output(scheduler, out, {"r": [5, 6, 4]}))
    assert request.output_token_ids == [4, 5, 6, 4]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert_all_free(scheduler)


def test_disable_by_batch_size_and_low_acceptance() -> None:
    scheduler = _spec_scheduler(disable_by_batch_size=2, max_num_batched_tokens=64)
    for i in range(2):
        scheduler.add_request(make_request(str(i), [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=20))
    out = scheduler.schedule()
    scheduler.update(out, _runner_output(scheduler, out, {"0": [3], "1": [3]}))
    assert not scheduler.schedule().scheduled_spec_decode_tokens  # 2 running: no speculation

    scheduler = _spec_scheduler(min_acceptance_rate=0.5)
    scheduler.add_request(make_request("r", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=40))
    out = scheduler.schedule()
    scheduler.update(out, _runner_output(scheduler, out, {"r": [3]}))
    num_verifications = 0
    for _ in range(12):  # every proposal rejected: the request pauses after a few
        out = scheduler.schedule()
        num_verifications += bool(out.scheduled_spec_decode_tokens)
        scheduler.update(out, _runner_output(scheduler, out, {"r": [9]}))
    assert 4 <= num_verifications < 12
    assert_all_free(scheduler)


# --- random accept / reject against a simulated model --------------------------------------------


class SimulatedModel:
    """A greedy "model" whose next token is a function of the context (so proposals from
    repeated text are often right, often wrong), and a KV store that records which token
    each slot was last written with: attention may only ever read slots holding the
    request's true tokens, prefix-cache hits included.

    Under method draft_model it also plays the runner's draft (worker/drafter.py): after the
    step, its own KV store gets the tokens the step made known, and each request given
    lookahead slots gets proposals (the model's token 70% of the time), each written at its
    position first, which must be a slot of the request's blocks. The draft too may only
    read slots holding true tokens."""

    def __init__(self, scheduler: Scheduler, seed: int) -> None:
        self.scheduler = scheduler
        self.seed = seed
        self.kv: dict[tuple[int, int], int] = {}
        self.draft_kv: dict[tuple[int, int], int] = {}
        spec = scheduler.spec
        self.num_draft_tokens = (
            spec.num_speculative_tokens if spec is not None and spec.config.drafts_by_model else 0
        )

    def next_token(self, context: list[int]) -> int:
        rng = random.Random(hash((self.seed, len(context), tuple(context[-3:]))))
        return context[-4] if rng.random() < 0.7 else rng.randrange(20, 24)

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        block_size = self.scheduler.block_size
        sampled: dict[str, list[int]] = {}
        draft_ids: dict[str, list[int]] = {}
        for request_id, num_new in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            drafts = out.scheduled_spec_decode_tokens.get(request_id, [])
            tokens = request.all_token_ids + drafts
            start = request.num_computed_tokens - num_new
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)

            def slot(pos: int, block_ids: list[int] = block_ids) -> tuple[int, int]:
                return block_ids[pos // block_size], pos % block_size

            for pos in range(start):  # what attention reads: the true tokens only
                assert self.kv.get(slot(pos)) == request.all_token_ids[pos], (request, pos)
            for pos in range(start, start + num_new):
                self.kv[slot(pos)] = tokens[pos]
            if start + num_new < request.num_tokens:
                self._draft(out, request, start, start + num_new, [], draft_ids)
                continue  # a prompt chunk that is not the last
            context, emitted = list(request.all_token_ids), []
            for i in range(len(drafts) + 1):
                token = self.next_token(context)
                emitted.append(token)
                if i == len(drafts) or token != drafts[i]:
                    break
                context.append(token)
            sampled[request_id] = emitted
            self._draft(out, request, start, start + num_new, emitted, draft_ids)
        output = _runner_output(self.scheduler, out, sampled)
        return dataclasses.replace(output, draft_token_ids=draft_ids)

    def _draft(
        self,
        out: SchedulerOutput,
        request: Request,
        start: int,
        end: int,
        emitted: list[int],
        draft_ids: dict[str, list[int]],
    ) -> None:
        """The draft after a step that ran positions start..end - 1 and emitted `emitted`."""
        if not self.num_draft_tokens:
            return
        block_size = self.scheduler.block_size
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        known = request.all_token_ids + emitted

        def slot(pos: int) -> tuple[int, int]:
            assert pos < len(block_ids) * block_size, "a draft write outside the blocks"
            return block_ids[pos // block_size], pos % block_size

        for pos in range(start):
            assert self.draft_kv.get(slot(pos)) == known[pos], (request, pos)
        lookahead = out.num_lookahead_tokens.get(request.request_id, 0)
        num_drafts = min(self.num_draft_tokens, end + lookahead - len(known) + 1)
        stop = end if not emitted else len(known) if num_drafts > 0 else len(known) - 1
        for pos in range(start, stop):
            self.draft_kv[slot(pos)] = known[pos]
        if not emitted or num_drafts <= 0:
            return
        context, proposals = list(known), []
        rng = random.Random(hash((self.seed, "draft", len(context))))
        for i in range(num_drafts):
            if i:  # the previous proposal's KV, at its position
                self.draft_kv[slot(len(context) - 1)] = context[-1]
            token = self.next_token(context) if rng.random() < 0.7 else rng.randrange(20, 24)
            proposals.append(token)
            context.append(token)
        draft_ids[request.request_id] = proposals


def _run(scheduler: Scheduler, seed: int, num_requests: int) -> dict[str, list[int]]:
    model = SimulatedModel(scheduler, seed)
    rng = random.Random(seed)
    period = [rng.randrange(10, 20) for _ in range(4)]
    finished: dict[str, list[int]] = {}
    pending = [
        make_request(str(i), period * 3 + [i], max_tokens=rng.randrange(8, 30))
        for i in range(num_requests)
    ]
    while pending or scheduler.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop())
        out = scheduler.schedule()
        for output in scheduler.update(out, model.run(out)):
            finished.setdefault(output.request_id, []).extend(output.new_token_ids)
        scheduler.check_integrity()
    assert_all_free(scheduler)
    return finished


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_random_accept_reject_same_tokens_no_leak(seed: int, method: str) -> None:
    """A small pool (preemptions), a small budget (chunks, cut proposals), prefix caching
    (shared prompts): the tokens equal those without speculation, nothing leaks, and no
    request ever reads a slot holding a rejected proposal."""
    settings = dict(num_blocks=14, block_size=4, max_num_batched_tokens=10, max_model_len=64)
    reference = _run(create_scheduler(**settings), seed, num_requests=6)
    speculative = _spec_scheduler(method, num_speculative_tokens=4, **settings)
    assert _run(speculative, seed, num_requests=6) == reference
    stats = speculative.make_stats().spec_decoding
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if seed == 3:  # most seeds meet preemptions with 14 blocks of 4; this one surely
        assert speculative.num_preemptions > 0
