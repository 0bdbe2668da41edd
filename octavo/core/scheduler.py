"""Scheduler: decides each step which requests run how many tokens, and applies what the
model sampled.

It owns the waiting queue, the running list, every Request's state and the KV cache manager,
and it is the only code that mutates a Request. It must not import torch or anything above
`core`: the runner learns what to do only from the SchedulerOutput, and the scheduler learns
what happened only from the ModelRunnerOutput.

The waiting queue is in arrival order under the `fcfs` scheduling policy (preempted requests
go back to its front), or under `priority` (vLLM's) in (priority, arrival time) order for every
request, preempted ones included; the admission policy is asked about its head either way.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.core.admission import (
    AdmissionCandidate,
    AdmissionPolicy,
    make_admission_policy,
    priority_key,
)
from octavo.core.block_hash import extend_block_hashes
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.outputs import EngineCoreOutput, ModelRunnerOutput
from octavo.core.request import FinishReason, Request, RequestStatus
from octavo.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from octavo.core.spec_decode import SpecDecoder
from octavo.metrics.stats import KVBlockEvent, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call has decided so far; undone in part when a victim that was
    already scheduled this step is preempted."""

    token_budget: int
    # Whether prompt chunks are capped at the long-prefill threshold (streams are decoding).
    cap_prompts: bool = False
    # Whether decoding requests verify their proposed tokens in this step.
    speculate: bool = False
    new_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Block ids appended this step to each scheduled running request.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The proposed tokens each scheduled request verifies (those that fit the budget).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Draft-model speculation: the KV slots allocated beyond each request's step, for the
    # draft's proposals after it (SchedulerOutput.num_lookahead_tokens).
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def add_running(self, request: Request, num_new_tokens: int, block_ids: list[int]) -> None:
        self._add(request, num_new_tokens)
        self.running_reqs.append(request)
        self.new_block_ids[request.request_id] = block_ids

    def add_new(self, request: Request, num_new_tokens: int) -> None:
        self._add(request, num_new_tokens)
        self.new_reqs.append(request)

    def _add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens

    def unschedule(self, request: Request) -> None:
        num_new_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_new_tokens is None:
            return
        self.token_budget += num_new_tokens
        self.running_reqs.remove(request)
        del self.new_block_ids[request.request_id]
        self.spec_token_ids.pop(request.request_id, None)
        self.num_lookahead_tokens.pop(request.request_id, None)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        policy: AdmissionPolicy | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """`speculative_config`: proposals made after each step (SpecDecoder) and verified in
        the next; None: none."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        # Without chunked prefill (an encoder) a prompt runs whole or waits.
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            group_windows=cache_config.group_windows,
            residency_sample=cache_config.kv_cache_metrics_sample,
        )
        # Under the priority scheduling policy its victim rule is priority_victim
        # (make_admission_policy); a policy passed in keeps its own.
        self.policy = policy if policy is not None else make_admission_policy(scheduler_config)
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        # Unfinished requests only; a request leaves when it finishes or is aborted.
        self.requests: dict[str, Request] = {}
        # FCFS, preempted requests back at the front; or sorted by priority_key.
        self.waiting: deque[Request] = deque()
        # Admission order, oldest first.
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(), among those the runner holds.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec = SpecDecoder(speculative_config) if speculative_config else None

    # --- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already scheduled.")
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        self.requests[request.request_id] = request
        if self.by_priority:
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def _insert_by_priority(self, request: Request) -> None:
        # After every request of the same key: equal keys keep the order they came in. A
        # deque's middle costs O(n / 64) to reach: cheap for queues of thousands.
        bisect.insort_right(self.waiting, request, key=priority_key)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests in any state: FINISHED_ABORTED, blocks freed now, out of the queues.

        Ids that are unknown or already finished are ignored. Requests the runner holds state
        for (RUNNING, or PREEMPTED: it keeps a seeded request's generator) are reported in the
        next SchedulerOutput.finished_req_ids. Returns the requests actually aborted.
        """
        aborted: list[Request] = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                self.finished_req_ids.add(request_id)
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
            if self.spec is not None:
                self.spec.finish(request)
            aborted.append(request)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return aborted

    # --- schedule -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        There is no prefill phase and no decode phase. Each request has `num_computed_tokens`
        (KV in the cache) catching up with `num_tokens` (prompt + output so far); a step gives
        it up to the difference, within one token budget (`max_num_batched_tokens`) shared by
        every request. A request with all but one token computed is decoding and runs 1
        token, or 1 + its proposed tokens (speculative decoding) when the step verifies
        them; any other runs a prompt chunk (or a recomputation after preemption). Proposed
        tokens count against the budget and get KV slots like any other; `update` rolls back
        those rejected.

        1) RUNNING requests, oldest first. One that cannot get a block preempts the policy's
           victim (under the priority policy: the least important, latest request) until it
           fits or is the victim itself.
        2) WAITING requests in queue order (FCFS or by priority), unless step 1 preempted:
           prefix-cache hits first, then a chunk that fits the budget. Stop at the first one
           that does not fit: a waiting request never preempts a running one, whatever their
           priorities (vLLM's rule; once admitted, step 1 lets it evict less important ones).
        3) Build the output, then advance `num_computed_tokens` by what was scheduled, so
           the output carries the counts from before this step.
        """
        plan = _StepPlan(token_budget=self.max_num_batched_tokens)
        # The long-prefill cap protects streams that are decoding (a step's time grows with the
        # prompt tokens it carries); a step without them takes prompts whole, oldest first.
        plan.cap_prompts = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        plan.speculate = self.spec is not None and self.spec.allows_step(len(self.running))
        self._schedule_running(plan)
        # A preemption says memory is short: admitting now would only preempt again.
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        self.policy.observe_step(self.running, len(plan.preempted_req_ids))
        output = self._make_output(plan)
        for request_id, num_new_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_new_tokens
            request.spec_token_ids = []  # verified now, or left out of this step
        return output

    def _schedule_running(self, plan: _StepPlan) -> None:
        # Iterate over a copy: preemption removes requests from self.running.
        for request in list(self.running):
            if plan.token_budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_remaining = request.num_tokens - request.num_computed_tokens
            drafts = request.spec_token_ids if plan.speculate and num_remaining == 1 else []
            num_new_tokens = self._chunk(num_remaining + len(drafts), plan)
            if num_new_tokens <= 0:
                continue
            lookahead = self._lookahead(request, request.num_computed_tokens, num_new_tokens, plan)
            block_ids = self._allocate_or_preempt(request, num_new_tokens + lookahead, plan)
            if block_ids is not None:
                plan.add_running(request, num_new_tokens, block_ids)
                if drafts and num_new_tokens > 1:
                    plan.spec_token_ids[request.request_id] = drafts[: num_new_tokens - 1]
                if lookahead:
                    plan.num_lookahead_tokens[request.request_id] = lookahead

    def _chunk(self, num_remaining: int, plan: _StepPlan) -> int:
        """Tokens a request runs this step: what it has left, within the step's budget and,
        where the step carries decoding streams, the long-prefill cap. Without chunked prefill
        (an encoder): all it has left, or 0 when that does not fit the budget."""
        if not self.enable_chunked_prefill:
            return num_remaining if num_remaining <= plan.token_budget else 0
        threshold = self.long_prefill_token_threshold
        if plan.cap_prompts and 0 < threshold < num_remaining:
            num_remaining = threshold
        return min(num_remaining, plan.token_budget)

    def _lookahead(
        self, request: Request, num_computed: int, num_new_tokens: int, plan: _StepPlan
    ) -> int:
        """KV slots beyond a step of num_new_tokens (after num_computed) for a draft model's
        proposals after it: where proposals come from a draft model, the step verifies, this
        step samples the request (its last known token is in it), the request may take two
        more tokens, and it is not paused for low acceptance; else 0."""
        spec = self.spec
        if spec is None or not plan.speculate or not spec.config.drafts_by_model:
            return 0
        end = num_computed + num_new_tokens
        if end < request.num_tokens or not spec.may_propose(request):
            return 0
        if request.max_tokens - request.num_output_tokens < 2:
            return 0
        return max(0, min(spec.num_speculative_tokens, self.max_model_len - end))

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: _StepPlan
    ) -> list[int] | None:
        """The request's new block ids, preempting victims as needed; None if it was itself
        preempted."""
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if block_ids is not None:
                return block_ids
            victim = self.policy.select_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        # A victim scheduled earlier in this step gives back its tokens and block delta; its
        # num_computed_tokens has not advanced yet, which free() relies on.
        plan.unschedule(victim)
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            # At its place by (priority, arrival), as vLLM's priority queue puts it back.
            self._insert_by_priority(victim)
        else:
            # Front of the queue: several victims in one step end up oldest first.
            self.waiting.appendleft(victim)
        plan.preempted_req_ids.add(victim.request_id)
        logger.debug("preempted %s", victim.request_id)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        # Requests whose grammar is still compiling (off the step loop) keep their place in
        # the queue while those behind them are considered.
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not request.grammar.is_ready():
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._chunk(request.num_tokens - num_hit_tokens, plan)
            if num_new_tokens == 0:
                break  # a whole prompt that does not fit this step's budget
            candidate = AdmissionCandidate(
                request,
                num_new_tokens,
                num_hit_tokens,
                num_free_hit_blocks=sum(1 for block in computed_blocks if block.ref_cnt == 0),
            )
            if not self.policy.can_admit(candidate, self.running, kv):
                break
            lookahead = self._lookahead(request, num_hit_tokens, num_new_tokens, plan)
            if kv.allocate_slots(request, num_new_tokens + lookahead, computed_blocks) is None:
                break
            if lookahead:
                plan.num_lookahead_tokens[request.request_id] = lookahead
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            plan.add_new(request, num_new_tokens)
        self.waiting.extendleft(reversed(skipped))

    def _group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """A newly scheduled request's lists of KV cache groups 1.. (whole: what was pending
        for them is in these)."""
        self.kv_cache_manager.take_new_group_block_ids(request_id)
        return self.kv_cache_manager.get_group_block_ids(request_id)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs = [
            NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                stop_token_ids=request.stop_token_ids,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                group_block_ids=self._group_block_ids(request.request_id),
                pooling_params=request.pooling_params,
            )
            for request in plan.new_reqs
        ]
        cached_reqs = [
            CachedRequestData(
                request_id=request.request_id,
                new_block_ids=plan.new_block_ids[request.request_id],
                num_computed_tokens=request.num_computed_tokens,
                new_group_block_ids=self.kv_cache_manager.take_new_group_block_ids(
                    request.request_id
                ),
            )
            for request in plan.running_reqs
        ]
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            preempted_req_ids=set(plan.preempted_req_ids),
            finished_req_ids=finished_req_ids,
            structured_output_req_ids=self._structured_output_req_ids(plan),
            scheduled_spec_decode_tokens=dict(plan.spec_token_ids),
            num_lookahead_tokens=dict(plan.num_lookahead_tokens),
        )

    def _structured_output_req_ids(self, plan: _StepPlan) -> list[str]:
        """Scheduled requests with a grammar whose step ends at their last known token, so
        that they sample (num_computed_tokens has not advanced yet)."""
        return [
            request_id
            for request_id, num_new_tokens in plan.num_scheduled_tokens.items()
            if (request := self.requests[request_id]).grammar is not None
            and request.num_computed_tokens + num_new_tokens >= request.num_tokens
        ]

    # --- update -------------------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, check token-level stops, free finished requests.

        The only place tokens are appended. Per token: append; a stop token (once min_tokens
        are out) finishes it as STOPPED; else the request's grammar, if any, takes the token,
        and a token that follows a complete grammar or that the grammar rejects finishes it as
        STOPPED like a stop token; else reaching max_tokens or max_model_len finishes it as
        LENGTH_CAPPED. Tokens after a stop are dropped. A grammar sees only tokens sampled
        here, so the recomputation after a preemption never feeds it twice. A token the grammar
        rejects (sampling is masked by it, so this is the grammar failing, never the model),
        and a request the runner reports in `failed`, end it as FINISHED_ERROR. Returns one
        output per request that got tokens or ended; a prefill chunk that is not the last gets
        none. A pooling request gets no token: the step that computed its last prompt token
        returns its vector (`runner_output.pooled`), and it ends there as STOPPED. Requests
        aborted since `schedule()` are skipped.

        Speculative decoding: a request that verified k proposed tokens gets the a accepted
        ones and one more (a + 1 <= k + 1 tokens); the KV of the k - a rejected positions is
        given up by rolling `num_computed_tokens` back (their slots stay with the request's
        blocks, to be overwritten; no block holding them was cached, since only known tokens
        are). Then each request still running gets its next proposal.
        """
        outputs: list[EngineCoreOutput] = []
        finished_any = False
        if self.spec is not None:
            self.spec.receive_drafts(runner_output.draft_token_ids)
        for request_id, reason in runner_output.failed.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            outputs.append(self._fail(request, reason))
            finished_any = True
        for request_id, pooled in runner_output.pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            outputs.append(self._finish_pooling(request, pooled))
            finished_any = True
        for request_id, token_ids, logprobs in zip(
            runner_output.req_ids,
            runner_output.sampled_token_ids,
            runner_output.logprobs,
            strict=True,
        ):
            request = self.requests.get(request_id)
            if not token_ids or request is None or request.status != RequestStatus.RUNNING:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                self._roll_back_rejected(request, len(drafts), len(token_ids) - 1)
            new_token_ids = self._append_tokens(request, token_ids)
            if request.status == RequestStatus.FINISHED_ERROR:
                # The token the grammar rejected is not part of the answer.
                outputs.append(self._fail(request, request.error or "", new_token_ids[:-1]))
                finished_any = True
                continue
            if request.is_finished:
                self._finish(request)
                finished_any = True
            else:
                if self.enable_caching:
                    extend_block_hashes(
                        request.block_hashes, request.all_token_ids, self.block_size
                    )
                if self.spec is not None:
                    self._propose(request)
            finish_reason = request.finish_reason
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=None if logprobs is None else logprobs[: len(new_token_ids)],
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=runner_output.prompt_logprobs.get(request_id),
                )
            )
        if finished_any:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Forget the KV of the proposed tokens that were rejected.

        ```
        before the step:  | computed ... | last | d_1 ... d_a | d_a+1 ... d_k |
        computed after:   |<------ num_computed_tokens ------>|  rejected     |
        tokens appended:                 | d_1 ... d_a, t |
        ```
        """
        assert self.spec is not None and 0 <= num_accepted <= num_drafts, request
        request.num_computed_tokens -= num_drafts - num_accepted
        self.spec.record(request.request_id, num_drafts, num_accepted)

    def _propose(self, request: Request) -> None:
        """The request's next proposal: none in a batch too large to speculate, where
        max_tokens or max_model_len leave room for the next token only, or after a complete
        grammar; a structured-output request's is cut at the first token its grammar rejects
        (each proposed position is then sampled under the grammar's mask after the proposals
        before it)."""
        assert self.spec is not None
        request.spec_token_ids = []
        if not self.spec.allows_step(len(self.running)):
            return
        grammar = request.grammar
        if grammar is not None and (grammar.is_terminated() or grammar.error() is not None):
            return
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        if room > 1:
            proposal = self.spec.propose(request, room - 1)
            if grammar is not None and proposal:
                proposal = proposal[: grammar.num_valid(proposal)]
            request.spec_token_ids = proposal

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append tokens one by one until a stop; returns those appended."""
        params = request.sampling_params
        for idx, token_id in enumerate(token_ids):
            request.append_output_token_ids([token_id])
            if (
                request.num_output_tokens >= params.min_tokens
                and token_id in request.stop_token_ids
            ):
                request.status = RequestStatus.FINISHED_STOPPED
                # A user's stop token is reported; EOS is not (vLLM's stop_reason).
                request.stop_reason = token_id if token_id in params.stop_token_ids else None
            elif request.grammar is not None and (error := request.grammar.error()) is not None:
                # Sampled under the mask of a failed grammar: the token means nothing.
                request.status = RequestStatus.FINISHED_ERROR
                request.error = error
            elif request.grammar is not None and request.grammar.is_terminated():
                # After a complete grammar only EOS can be sampled, a stop token unless the
                # request ignores EOS; ending on the completing token instead would drop its
                # text. vLLM ends on the next one too.
                request.status = RequestStatus.FINISHED_STOPPED
            elif request.grammar is not None and not request.grammar.accept_token(token_id):
                logger.warning(
                    "request %s: its grammar rejected the sampled token %d",
                    request.request_id,
                    token_id,
                )
                request.status = RequestStatus.FINISHED_ERROR
                request.error = request.grammar.error() or (
                    f"the structured-output grammar rejected token {token_id}"
                )
            elif (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if request.is_finished:
                return token_ids[: idx + 1]
        return list(token_ids)

    def _finish_pooling(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """End a pooling request whose whole prompt is computed (its blocks freed)."""
        request.status = RequestStatus.FINISHED_STOPPED
        request.pooled = pooled
        self._finish(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            new_logprobs=None,
            finish_reason=FinishReason.STOP,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooled=pooled,
        )

    def _fail(
        self, request: Request, reason: str, new_token_ids: list[int] | None = None
    ) -> EngineCoreOutput:
        """End `request` as FINISHED_ERROR (its blocks freed) and say so to the caller."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = reason
        self._finish(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids or [],
            new_logprobs=None,
            finish_reason=FinishReason.ERROR,
            error=reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _finish(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.spec is not None:
            self.spec.finish(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # --- queries ------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id; None once it has finished or been aborted."""
        return self.requests.get(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while any block is held."""
        return self.kv_cache_manager.reset_prefix_cache()

    def take_residency_events(self) -> list[tuple[KVBlockEvent, int]]:
        """What happened to the KV blocks sampled for residency metrics since the last call,
        as (event, block id) in order (none unless the cache config samples some). The caller
        stamps them with the time of the step that made them."""
        return self.kv_cache_manager.take_residency_events()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_deferred_reqs=sum(
                1
                for request in self.waiting
                if request.grammar is not None and not request.grammar.is_ready()
            ),
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            spec_decoding=(
                None
                if self.spec is None
                else SpecDecodingStats(
                    num_drafts=self.spec.counters.num_drafts,
                    num_draft_tokens=self.spec.counters.num_draft_tokens,
                    num_accepted_tokens=self.spec.counters.num_accepted_tokens,
                    num_accepted_tokens_per_pos=tuple(
                        self.spec.counters.num_accepted_tokens_per_pos
                    ),
                )
            ),
        )

    def check_integrity(self) -> None:
        """Assert queues, request states and blocks agree: running requests hold blocks that
        cover their computed tokens, waiting ones hold none, so with nothing running every
        block is free."""
        kv = self.kv_cache_manager
        kv.check_integrity()
        assert len(self.requests) == len(self.running) + len(self.waiting)
        assert kv.req_to_blocks.keys() == {r.request_id for r in self.running}
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            assert self.requests[request.request_id] is request
            num_block_tokens = len(kv.req_to_blocks[request.request_id]) * self.block_size
            assert request.num_computed_tokens <= num_block_tokens, request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert self.requests[request.request_id] is request
            assert request.num_computed_tokens == 0, request
        if self.by_priority:
            keys = [priority_key(request) for request in self.waiting]
            assert keys == sorted(keys), keys
        if not self.running:
            assert kv.num_free_blocks == kv.num_blocks
