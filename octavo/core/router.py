"""Which engine replica a request goes to: the one that holds the longest cached prefix of its
prompt, unless that would overload it; otherwise the least loaded one.

Used by the API server in front of its data-parallel engine-core processes (keys: the prefix
cache's own block hashes of the prompt's token ids, so a match here is a match there) and by
`octavo router` in front of several servers (keys: hashes of the prompt's text in chunks).

What a replica holds is not asked of it: the router remembers the keys of the prompts it sent
there, most recent last, at most `capacity` keys per replica (about its pool's blocks), and
forgets the oldest first, as the replica's pool evicts its least recently used blocks. That
view is approximate (a replica evicts under its own pressure) and costs nothing per step; it is
the view SGLang's router keeps in its radix tree.

The guard: a replica may take a request for its cached prefix only while it holds at most
`balance_abs` requests more than the least loaded one and at most `balance_rel` times as many;
past that the least loaded one gets it (and from then on holds that prefix too). Load is the
number of requests a replica has and has not finished, as counted here.

Plain Python: no torch, no sockets.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence

# A cached prefix may pull a request to a replica holding this many requests more than the
# least loaded one, and this many times as many, but no more. Small: on a CPU a replica's step
# time grows with every request it holds, so a wait costs more than a prefill of a few blocks.
DEFAULT_BALANCE_ABS = 4
DEFAULT_BALANCE_REL = 1.5


class PrefixRouter:
    def __init__(
        self,
        num_replicas: int,
        capacity: int,
        balance_abs: int = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}.")
        self.num_replicas = num_replicas
        self.capacity = max(capacity, 1)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.load = [0] * num_replicas
        self.live = [True] * num_replicas
        self._keys: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        # Ties between equally good replicas go round, not always to the first.
        self._turn = itertools.count()

    def match(self, replica: int, keys: Sequence[int]) -> int:
        """How many of `keys` (chained: each stands for the prefix up to it), from the first,
        `replica` is thought to hold."""
        held = self._keys[replica]
        for num_matched, key in enumerate(keys):
            if key not in held:
                return num_matched
        return len(keys)

    def choose(self, keys: Sequence[int], exclude: Container[int] = ()) -> int:
        """The replica for a prompt with these prefix keys, other than those in `exclude`
        (tried already); ValueError if none is live."""
        live = [r for r in range(self.num_replicas) if self.live[r] and r not in exclude]
        if not live:
            raise ValueError("no engine replica is running.")
        min_load = min(self.load[r] for r in live)
        # Round-robin among equals: the candidates start at a turning offset, and min / max
        # keep the first of equals.
        shift = next(self._turn) % len(live)
        live = live[shift:] + live[:shift]
        matches = {r: self.match(r, keys) for r in live} if keys else {}
        best = max(live, key=lambda r: (matches.get(r, 0), -self.load[r]))
        if matches.get(best, 0) > 0 and self._within_guard(self.load[best], min_load):
            return best
        return min(live, key=lambda r: (self.load[r], -matches.get(r, 0)))

    def _within_guard(self, load: int, min_load: int) -> bool:
        return load - min_load <= self.balance_abs or load <= min_load * self.balance_rel

    def assign(self, replica: int, keys: Sequence[int], num_requests: int = 1) -> None:
        """`replica` took `num_requests` requests whose prompt has these keys."""
        self.load[replica] += num_requests
        held = self._keys[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def route(
        self, keys: Sequence[int], num_requests: int = 1, exclude: Container[int] = ()
    ) -> int:
        """choose + assign."""
        replica = self.choose(keys, exclude)
        self.assign(replica, keys, num_requests)
        return replica

    def finished(self, replica: int, num_requests: int = 1) -> None:
        self.load[replica] = max(self.load[replica] - num_requests, 0)

    def forget(self, replica: int | None = None) -> None:
        """Drop what `replica` (or every replica) is thought to hold: its cache was reset."""
        for r in range(self.num_replicas) if replica is None else (replica,):
            self._keys[r].clear()

    def mark_dead(self, replica: int) -> None:
        """No more requests go to `replica`; what it held is forgotten (a restarted server
        starts with an empty cache)."""
        self.live[replica] = False
        self._keys[replica].clear()

    def mark_live(self, replica: int) -> None:
        self.live[replica] = True
