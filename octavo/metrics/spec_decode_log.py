"""The periodic speculative decoding log line (vLLM's "SpecDecoding metrics: ..."): every
`interval_s`, what the proposals achieved since the last line, mean acceptance length first.

A StatLogger fed each step's SchedulerStats; it keeps the last cumulative counts it logged,
per engine (a data-parallel replica logs its own line).
Must not: raise into the step, or log when nothing was proposed since the last line.
"""

from __future__ import annotations

import logging
import time

from octavo.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

# vLLM logs its engine stats every 10 s.
LOG_INTERVAL_S = 10.0


class SpecDecodingLogger:
    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        # Engine index -> the counts and the time of its last line.
        self._last: dict[int, tuple[SpecDecodingStats, float]] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats,
        engine_index: int = 0,
    ) -> None:
        stats = scheduler_stats.spec_decoding
        if stats is None:
            return
        now = time.monotonic()
        last, last_time = self._last.setdefault(engine_index, (SpecDecodingStats(), now))
        if now - last_time < self.interval_s:
            return
        self._last[engine_index] = stats, now
        line = format_line(stats, last, now - last_time)
        if line:
            logger.info("%s%s", f"engine {engine_index}: " if engine_index else "", line)


def format_line(now: SpecDecodingStats, before: SpecDecodingStats, elapsed_s: float) -> str:
    """The line for the counts between two snapshots ("" when no draft was verified)."""
    num_drafts = now.num_drafts - before.num_drafts
    if num_drafts <= 0:
        return ""
    num_draft_tokens = now.num_draft_tokens - before.num_draft_tokens
    num_accepted = now.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        (
            pos_now
            - (before.num_accepted_tokens_per_pos[i] if before.num_accepted_tokens_per_pos else 0)
        )
        / num_drafts
        for i, pos_now in enumerate(now.num_accepted_tokens_per_pos)
    ]
    # A line right after the first snapshot has no time to divide by.
    per_s = 1 / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + num_accepted / num_drafts:.2f}, "
        f"Accepted throughput: {num_accepted * per_s:.2f} tokens/s, "
        f"Drafted throughput: {num_draft_tokens * per_s:.2f} tokens/s, "
        f"Accepted: {num_accepted} tokens, Drafted: {num_draft_tokens} tokens, "
        f"Per-position acceptance rate: {', '.join(f'{rate:.3f}' for rate in per_pos)}, "
        f"Avg Draft acceptance rate: {100 * num_accepted / max(num_draft_tokens, 1):.1f}%"
    )
