"""Speculative decoding's proposals: which tokens a request verifies after its next one.

`SpecDecoder` is what the scheduler holds when speculative decoding is on: after a step it
proposes each decoding request's next tokens (`propose`), it is told how many the rejection
sampler accepted (`record`), and it decides when proposing does not pay: in a step with
`disable_by_batch_size` running requests or more, and for a request whose recent proposals
are mostly rejected (paused for a number of its steps that doubles each time). It keeps the
cumulative counters behind vLLM's spec_decode metrics.

Proposers are plain Python over token ids (no model): `ngram` looks the request's latest
n-gram up in its own prompt and output; `suffix` also in a bounded cache of earlier requests'
outputs; `draft_model` hands on what the runner's draft model proposed after the step
(ModelRunnerOutput.draft_token_ids, received before the step's proposals are asked for).
Must not: change a Request (the scheduler does), or know about the runner's tensors.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from octavo.config import SpeculativeConfig
from octavo.core.request import Request

# suffix: most tokens of earlier outputs the cache holds (on top of its request count), and
# the most recent places kept per indexed n-gram. A cached token costs about 150 bytes (its
# int in a list, its index entry), so the cache stays under ~40 MB.
SUFFIX_CACHE_MAX_TOKENS = 262_144
SUFFIX_PLACES_PER_KEY = 4

# The per-request switch-off: the weight of the latest proposal in a request's acceptance
# average, the proposals it makes before it can be paused, and the pauses (in its steps).
_ACCEPTANCE_WEIGHT = 0.25
_MIN_DRAFTS_BEFORE_PAUSE = 4
_FIRST_PAUSE_STEPS = 8
_MAX_PAUSE_STEPS = 256


def find_continuation(
    token_ids: list[int] | array, min_n: int, max_n: int, max_num_tokens: int
) -> tuple[int, list[int]]:
    """The longest n-gram (min_n <= n <= max_n) that ends `token_ids` and also occurs earlier
    in them, and the tokens that followed its latest earlier occurrence (at most
    max_num_tokens): (n, tokens), or (0, []) where none occurs."""
    num_tokens = len(token_ids)
    if max_num_tokens <= 0 or num_tokens <= min_n:
        return 0, []
    tokens = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    data = tokens.tobytes()
    # An earlier occurrence ends before the last token: a token follows it.
    limit = 4 * (num_tokens - 1)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        pattern = data[-4 * n :]
        pos = data.rfind(pattern, 0, limit)
        while pos > 0 and pos % 4:  # a match across token boundaries: look before it
            pos = data.rfind(pattern, 0, pos + 4 * n - 1)
        if pos >= 0:
            start = pos // 4 + n
            return n, list(tokens[start : start + max_num_tokens])
    return 0, []


class NgramProposer:
    """Prompt lookup (vLLM's ngram): the tokens that followed the latest earlier occurrence
    of the longest n-gram, prompt_lookup_max down to prompt_lookup_min, ending the request."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        return find_continuation(request.all_token_ids, self.min_n, self.max_n, max_num_tokens)[1]

    def finish(self, request: Request) -> None:
        """Nothing is kept across requests."""


class DraftModelProposer:
    """method draft_model: the proposals the runner's draft model made after the last step,
    for the requests the scheduler gave lookahead slots (the runner proposes; this passes
    them on, each once, at most max_num_tokens)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.drafts: dict[str, list[int]] = {}

    def receive(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The last step's proposals; those of an earlier step are stale now."""
        self.drafts = draft_token_ids

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        return self.drafts.pop(request.request_id, [])[:max_num_tokens]

    def finish(self, request: Request) -> None:
        self.drafts.pop(request.request_id, None)


@dataclass(slots=True)
class _CachedOutput:
    seq_id: int
    tokens: array


class SuffixProposer:
    """Suffix decoding: the longest match of the request's latest tokens, in its own tokens
    (as ngram) or in the outputs of earlier requests (the cache), proposes what followed.

    The cache is a hashed n-gram index, not a tree: each prompt_lookup_min-gram of a cached
    output maps to its latest SUFFIX_PLACES_PER_KEY places; a candidate place's match is
    then extended backwards, up to suffix_decoding_max_tree_depth tokens. Its memory is
    bounded by suffix_decoding_max_cached_requests outputs and SUFFIX_CACHE_MAX_TOKENS tokens:
    the oldest outputs are evicted first (FIFO, vLLM's order), their index entries with them.
    A match of m tokens proposes at most suffix_decoding_max_spec_factor * m tokens, and the
    match plus the proposal stay within the depth (vLLM's rules); of a longer match only as
    many last tokens count as leave the proposal num_speculative_tokens within the depth.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.key_len = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_cached_tokens = SUFFIX_CACHE_MAX_TOKENS
        self.outputs: deque[_CachedOutput] = deque()
        self.by_id: dict[int, _CachedOutput] = {}
        # n-gram -> [(seq_id, index of the token after it)], latest last.
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.num_cached_tokens = 0
        self._next_seq_id = 0

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        own_n, own = find_continuation(
            request.all_token_ids, self.key_len, min(self.max_n, self.max_depth), max_num_tokens
        )
        n, tokens = self._lookup(request.all_token_ids)
        if own_n >= n:
            n, tokens = own_n, own
        # The match's last tokens alone match at the same place: count no more of it than
        # leaves the proposal its room within the depth (a 24-token match at depth 24 would
        # otherwise propose nothing).
        n = min(n, max(self.max_depth - max_num_tokens, self.key_len))
        cap = min(max_num_tokens, int(self.spec_factor * n), self.max_depth - n)
        return tokens[: max(cap, 0)]

    def _lookup(self, token_ids: list[int]) -> tuple[int, list[int]]:
        """The longest match in the cache and up to max_depth tokens that followed it."""
        if len(token_ids) < self.key_len:
            return 0, []
        places = self.index.get(tuple(token_ids[-self.key_len :]), ())
        best_n, best = 0, []
        for seq_id, after in reversed(places):
            cached = self.by_id[seq_id].tokens
            n = self.key_len
            limit = min(self.max_depth, after, len(token_ids))
            while n < limit and cached[after - n - 1] == token_ids[-n - 1]:
                n += 1
            if n > best_n and after < len(cached):
                best_n, best = n, list(cached[after : after + self.max_depth])
        return best_n, best

    def finish(self, request: Request) -> None:
        """Cache the output of a request that ended (its last max tokens if it is longer than
        the whole cache may hold), evicting the oldest outputs to stay within bounds."""
        if not self.max_cached_requests or len(request.output_token_ids) <= self.key_len:
            return
        tokens = array("I", request.output_token_ids[-self.max_cached_tokens :])
        entry = _CachedOutput(self._next_seq_id, tokens)
        self._next_seq_id += 1
        while self.outputs and (
            len(self.outputs) >= self.max_cached_requests
            or self.num_cached_tokens + len(tokens) > self.max_cached_tokens
        ):
            self._evict(self.outputs.popleft())
        self.outputs.append(entry)
        self.by_id[entry.seq_id] = entry
        self.num_cached_tokens += len(tokens)
        k = self.key_len
        for end in range(k, len(tokens)):
            places = self.index.setdefault(tuple(tokens[end - k : end]), [])
            places.append((entry.seq_id, end))
            if len(places) > SUFFIX_PLACES_PER_KEY:
                del places[0]

    def _evict(self, entry: _CachedOutput) -> None:
        del self.by_id[entry.seq_id]
        self.num_cached_tokens -= len(entry.tokens)
        k, tokens = self.key_len, entry.tokens
        for end in range(k, len(tokens)):
            key = tuple(tokens[end - k : end])
            places = self.index.get(key)
            if places is None:
                continue
            places[:] = [p for p in places if p[0] != entry.seq_id]
            if not places:
                del self.index[key]


PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer, "draft_model": DraftModelProposer}


@dataclass(slots=True)
class _Acceptance:
    """One request's recent acceptance (a moving average of accepted / proposed tokens) and
    its pause, counted in its own steps."""

    rate: float = 1.0
    num_drafts: int = 0
    steps_paused: int = 0
    next_pause: int = _FIRST_PAUSE_STEPS


@dataclass(slots=True)
class SpecDecodeCounters:
    """Cumulative since start-up (vLLM's spec_decode counters): verification steps that had
    proposed tokens, those tokens, those accepted, and accepted ones per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = PROPOSERS[config.method](config)
        self.acceptance: dict[str, _Acceptance] = {}
        self.counters = SpecDecodeCounters(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )

    def allows_step(self, num_running: int) -> bool:
        """Whether a step with num_running running requests verifies proposals."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def may_propose(self, request: Request) -> bool:
        """Whether the request's next proposal may be other than none (it is not paused):
        what decides if a draft model drafts for it."""
        state = self.acceptance.get(request.request_id)
        return state is None or state.steps_paused == 0

    def receive_drafts(self, draft_token_ids: dict[str, list[int]]) -> None:
        """A step's proposals made by the runner's draft model (method draft_model)."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.receive(draft_token_ids)

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_num_tokens) tokens for the request to verify
        after its next one; none while it is paused."""
        state = self.acceptance.setdefault(request.request_id, _Acceptance())
        if state.steps_paused > 0:
            state.steps_paused -= 1
            return []
        return self.proposer.propose(request, min(self.num_speculative_tokens, max_num_tokens))

    def record(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """A verification: num_accepted of num_draft_tokens proposed tokens were accepted."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_draft_tokens
        counters.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            counters.num_accepted_tokens_per_pos[pos] += 1
        floor = self.config.min_acceptance_rate
        state = self.acceptance.setdefault(request_id, _Acceptance())
        state.num_drafts += 1
        state.rate += _ACCEPTANCE_WEIGHT * (num_accepted / num_draft_tokens - state.rate)
        if state.num_drafts >= _MIN_DRAFTS_BEFORE_PAUSE and state.rate < floor:
            state.steps_paused = state.next_pause
            state.next_pause = min(2 * state.next_pause, _MAX_PAUSE_STEPS)
            # After the pause, one more poor proposal or two pause it again.
            state.rate = 2 * floor

    def finish(self, request: Request) -> None:
        """The request has ended: forget its state; suffix caches an output that ended by
        itself (stopped or capped), not an aborted one."""
        self.acceptance.pop(request.request_id, None)
        if request.finish_reason in ("stop", "length"):
            self.proposer.finish(request)
