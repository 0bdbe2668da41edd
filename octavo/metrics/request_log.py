"""The request log (`--request-log PATH`): one JSON line per finished request, appended.

Each line holds what capacity planning needs and no content: lengths (prompt_tokens,
completion_tokens, max_tokens), finish_reason, and what the user felt (ttft_s, the largest
gap between tokens, evictions and their freezes). `octavo plan` reads it back.

Must not: log prompt or output text, or hold more than the open file (lines are written as
requests finish, on the engine thread; the file is line-buffered, so a crash loses no line).
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from octavo.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats


def request_log_entry(finished: FinishedRequestStats) -> dict[str, Any]:
    """The JSON object logged for one finished request (times in seconds, 6 decimals)."""

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    return {
        "request_id": finished.request_id,
        "prompt_tokens": finished.num_prompt_tokens,
        "completion_tokens": finished.num_generation_tokens,
        "max_tokens": finished.max_tokens,
        "finish_reason": finished.finish_reason,
        "ttft_s": seconds(finished.ttft_s),
        "max_token_gap_s": seconds(finished.max_token_gap_s),
        "evictions": finished.num_evictions,
        "eviction_freezes_s": [seconds(f) for f in finished.eviction_freezes_s],
        "queue_time_s": seconds(finished.queue_time_s),
        "e2e_latency_s": seconds(finished.e2e_latency_s),
    }


class RequestLogWriter:
    """A stat logger that appends one line per finished request to `path`."""

    def __init__(self, path: str) -> None:
        try:
            self._file: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise ValueError(f"request_log={path!r} cannot be opened for appending: {exc}") from exc
        self.path = path

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats,
        engine_index: int = 0,
    ) -> None:
        for finished in iteration_stats.finished_requests:
            self._file.write(json.dumps(request_log_entry(finished)) + "\n")

    def close(self) -> None:
        self._file.close()
