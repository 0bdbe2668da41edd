"""Speculative decoding's metrics: vLLM's counters fed from the scheduler's cumulative counts,
the per-position family read back as one Vector, and the periodic log line."""

from __future__ import annotations

import logging

from octavo.metrics.prometheus import PrometheusStatLogger
from octavo.metrics.reader import Counter, Vector, get_metrics_snapshot
from octavo.metrics.spec_decode_log import SpecDecodingLogger, format_line
from octavo.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats


def _snapshot(logger: PrometheusStatLogger) -> dict[str, object]:
    return {
        m.name: m.values if isinstance(m, Vector) else m.value
        for m in get_metrics_snapshot(logger.registry)
        if m.name.startswith("vllm:spec_decode") and isinstance(m, (Counter, Vector))
    }


def test_counters_and_vector() -> None:
    logger = PrometheusStatLogger("m", num_speculative_tokens=3)
    logger.record(SchedulerStats(spec_decoding=SpecDecodingStats(2, 6, 3, (2, 1, 0))))
    logger.record(SchedulerStats(spec_decoding=SpecDecodingStats(5, 15, 7, (4, 2, 1))))
    assert _snapshot(logger) == {
        "vllm:spec_decode_num_drafts": 5,
        "vllm:spec_decode_num_draft_tokens": 15,
        "vllm:spec_decode_num_accepted_tokens": 7,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [4, 2, 1],
    }
    text = logger.render().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",' in text
    assert not _snapshot(PrometheusStatLogger("m"))  # declared only with speculation


def test_log_line(caplog) -> None:
    before = SpecDecodingStats(2, 6, 3, (2, 1, 0))
    now = SpecDecodingStats(6, 18, 9, (5, 3, 1))
    line = format_line(now, before, 2.0)
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.50, ")
    assert "Accepted: 6 tokens, Drafted: 12 tokens" in line
    assert "Per-position acceptance rate: 0.750, 0.500, 0.250" in line
    assert line.endswith("Avg Draft acceptance rate: 50.0%")
    assert format_line(now, now, 1.0) == ""
    spec_logger = SpecDecodingLogger(interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="octavo.metrics.spec_decode_log"):
        spec_logger.record(SchedulerStats(spec_decoding=now), IterationStats())
    assert "Mean acceptance length: 2.50" in caplog.text
