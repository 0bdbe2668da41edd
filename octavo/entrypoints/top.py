"""`octavo top URL`: a live view of a server's memory and work, like htop, in a terminal.

Each refresh reads GET /v1/kv (the KV pool and every unfinished request: core/kv_view.py) and
GET /metrics (the Prometheus counters), and redraws one screen with plain ANSI codes: a
header with the KV usage bar, tokens/s, running and waiting counts, preemptions (evictions),
the freezes they caused and the requests shed, then one row per request. Tokens/s and the
freezes are the counters' increase since the previous screen; the first screen (and
`--once`) shows the rates the engine measured on its own recent steps instead.

Must not: change the server; it only reads those two endpoints (any API key given is sent).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_CLEAR = "\x1b[H\x1b[2J"
# The counters the header reads from /metrics (summed over their labels).
_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "preemptions": "vllm:num_preemptions",
    "evicted_requests": "octavo:num_requests_evicted",
    "finished": "vllm:request_success",
    "shed": "vllm:admission_rejections",
}
_FREEZES = "octavo:eviction_freeze_seconds"


@dataclass(frozen=True)
class Sample:
    """One reading of the server, at `time_s` (monotonic)."""

    time_s: float
    kv: dict[str, Any]
    counters: dict[str, float]
    # The freeze histogram's count and sum (seconds).
    num_freezes: float
    freeze_sum_s: float


def add_top_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period"
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="the server's API key (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--max-rows", type=int, default=None, metavar="N", help="request rows shown"
    )


def read_sample(client: httpx.Client) -> Sample:
    """GET /v1/kv and /metrics once. httpx.HTTPError on a failed request."""
    kv = client.get("/v1/kv")
    kv.raise_for_status()
    metrics = client.get("/metrics")
    metrics.raise_for_status()
    counters = dict.fromkeys(_COUNTERS, 0.0)
    by_family = {family: key for key, family in _COUNTERS.items()}
    num_freezes = freeze_sum_s = 0.0
    for family in text_string_to_metric_families(metrics.text):
        key = by_family.get(family.name)
        for sample in family.samples:
            if key is not None and sample.name == family.name + "_total":
                counters[key] += sample.value
            elif family.name == _FREEZES and sample.name == _FREEZES + "_count":
                num_freezes += sample.value
            elif family.name == _FREEZES and sample.name == _FREEZES + "_sum":
                freeze_sum_s += sample.value
    return Sample(time.monotonic(), kv.json(), counters, num_freezes, freeze_sum_s)


def render(
    sample: Sample,
    previous: Sample | None = None,
    url: str = "",
    width: int = 100,
    max_rows: int | None = None,
) -> str:
    """One screen of text (no ANSI codes) for `sample`, with rates since `previous`."""
    kv = sample.kv
    counters = sample.counters
    lines = [f"octavo top  {url}".rstrip()]
    usage = kv["usage"]
    bar_width = max(width - 40, 10)
    filled = round(usage * bar_width)
    lines.append(
        f"KV  [{'#' * filled}{'.' * (bar_width - filled)}] {usage * 100:5.1f}%  "
        f"{kv['num_blocks'] - kv['num_free_blocks']}/{kv['num_blocks']} blocks of "
        f"{kv['block_size']}"
    )
    lines.append(
        f"    free {kv['num_free_blocks']}  cached prefixes {kv['num_cached_blocks']} blocks  "
        f"prefix hits {_share(kv['prefix_cache_hits'], kv['prefix_cache_queries'])} of "
        f"{kv['prefix_cache_queries']} tokens  cached blocks evicted "
        f"{kv['num_evicted_cached_blocks']}"
    )
    lines.append(_rates_line(sample, previous))
    freezes = sample.num_freezes - (previous.num_freezes if previous else 0.0)
    freeze_s = sample.freeze_sum_s - (previous.freeze_sum_s if previous else 0.0)
    since = "since last screen" if previous else "since start"
    mean = f" (mean {freeze_s / freezes:.2f} s)" if freezes else ""
    lines.append(
        f"Requests  running {kv['num_running_reqs']}  waiting {kv['num_waiting_reqs']}  "
        f"finished {counters['finished']:.0f}  shed {counters['shed']:.0f}"
    )
    lines.append(
        f"Evictions  {counters['preemptions']:.0f} preemptions of "
        f"{counters['evicted_requests']:.0f} requests  freezes {freezes:.0f} {since}{mean}"
    )
    queue = kv.get("queue", {})
    predicted = queue.get("predicted_ttft_s")
    lines.append(
        f"Queue  {queue.get('num_prompt_tokens', 0)} prompt tokens to prefill  "
        f"predicted TTFT {'-' if predicted is None else f'{predicted:.2f} s'}"
        + (f" (shed over {queue['max_queue_wait_s']:g} s)" if queue.get("max_queue_wait_s") else "")
    )
    if kv.get("sleep_level") is not None:
        lines.append(f"ASLEEP (level {kv['sleep_level']})")
    lines.append("")
    lines.extend(_request_table(kv["requests"], max_rows))
    return "\n".join(line[:width] for line in lines)


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _rates_line(sample: Sample, previous: Sample | None) -> str:
    if previous is not None and sample.time_s > previous.time_s:
        elapsed_s = sample.time_s - previous.time_s
        prompt = (sample.counters["prompt_tokens"] - previous.counters["prompt_tokens"]) / elapsed_s
        output = (
            sample.counters["generation_tokens"] - previous.counters["generation_tokens"]
        ) / elapsed_s
        return f"Tokens/s  prompt {prompt:.1f}  output {output:.1f}  (last {elapsed_s:.1f} s)"
    rates = sample.kv.get("rates", {})
    busy = rates.get("tokens_per_s")
    output = rates.get("generation_tokens_per_s")
    if busy is None:
        return "Tokens/s  - (no step measured yet)"
    return (
        f"Tokens/s  {busy:.1f} run, {output:.1f} output (recent steps, while busy)  "
        f"step {_ms(rates.get('decode_step_s'))} + {_ms(rates.get('prompt_token_s'))}/prompt token"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


_COLUMNS = (
    ("ID", 20),
    ("ENG", 3),
    ("STATE", 9),
    ("PROMPT", 6),
    ("COMPUTED", 8),
    ("OUTPUT", 9),
    ("BLOCKS", 6),
    ("SHARED", 6),
    ("CACHED", 6),
    ("EVICT", 5),
)


def _request_table(requests: list[dict[str, Any]], max_rows: int | None) -> list[str]:
    header = " ".join(
        f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(_COLUMNS)
    )
    rows = [header]
    shown = requests if max_rows is None else requests[:max_rows]
    for r in shown:
        cells = (
            _tail(r["request_id"], _COLUMNS[0][1]),
            r.get("engine", 0),
            r["state"],
            r["num_prompt_tokens"],
            r["num_computed_tokens"],
            f"{r['num_output_tokens']}/{r['max_tokens']}",
            r["num_blocks"],
            r["num_shared_blocks"],
            r["num_cached_tokens"],
            r["num_preemptions"],
        )
        rows.append(
            " ".join(
                f"{cell:>{w}}" if i else f"{cell:<{w}}"
                for i, (cell, (_, w)) in enumerate(zip(cells, _COLUMNS, strict=True))
            )
        )
    if len(shown) < len(requests):
        rows.append(f"... {len(requests) - len(shown)} more")
    if not requests:
        rows.append("(no request in the engine)")
    return rows


def _tail(text: str, width: int) -> str:
    """The end of a long id (ids differ at their ends)."""
    return text if len(text) <= width else "~" + text[-(width - 1) :]


def run_top(ns: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    url = ns.url.rstrip("/")
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        try:
            sample = read_sample(client)
        except httpx.HTTPError as exc:
            print(f"octavo top: cannot read {url}/v1/kv and /metrics: {exc}", file=sys.stderr)
            return 1
        width = _terminal_width()
        if ns.once:
            print(render(sample, None, url, width, ns.max_rows))
            return 0
        previous = None
        try:
            while True:
                rows = ns.max_rows if ns.max_rows is not None else max(_terminal_rows() - 12, 1)
                sys.stdout.write(_CLEAR + render(sample, previous, url, width, rows) + "\n")
                sys.stdout.flush()
                time.sleep(ns.interval)
                previous = sample
                try:
                    sample = read_sample(client)
                except httpx.HTTPError as exc:
                    sys.stdout.write(f"\nlost {url}: {exc}\n")
                    return 1
        except KeyboardInterrupt:
            return 0


def _terminal_width() -> int:
    return os.get_terminal_size().columns if sys.stdout.isatty() else 100


def _terminal_rows() -> int:
    return os.get_terminal_size().lines if sys.stdout.isatty() else 40
