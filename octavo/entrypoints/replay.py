"""`octavo replay record|check`: the upgrade gate. Record a golden set of requests and their
greedy responses from one server, then send the same requests to another (a new octavo, or
vLLM, or any OpenAI-compatible server) and report what changed.

    record --requests FILE --url URL -o golden.jsonl
        FILE holds one request a line: an OpenAI body (`messages` for /v1/chat/completions,
        `prompt` for /v1/completions) or a batch line (`url` and `body`, as `octavo
        run-batch` takes them). A body without `temperature` gets 0 (greedy), and one without
        logprobs asks for them (1 per token: the tokens come back in the response), so that
        outputs compare token for token.
    check golden.jsonl --against URL
        sends each recorded body again (in the order recorded) and compares, request by
        request: the status, each choice's tokens (their logprobs' tokens where both sides
        returned them, else the text), finish reasons, prompt and completion token counts;
        and the end-to-end latency's p50 and p99 against the golden run's. Prints a table;
        exits 1 when a count of differing requests, or a latency ratio, is past its
        threshold (flags; by default any output difference fails, and latency fails past
        1.5x + 0.05 s), 2 when it cannot run.

octavo's request log (--request-log) keeps lengths and times, never prompt text, so it cannot
be replayed: `record --from-log` says so and names what to do instead.

Must not: change the servers (it sends the recorded requests, nothing else).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The per-request comparisons, in the table's order: (name, what it compares).
CHECKS = (
    ("status", "HTTP status"),
    ("output", "tokens (text where a side has no logprobs)"),
    ("finish_reason", "finish reasons"),
    ("prompt_tokens", "usage.prompt_tokens"),
    ("completion_tokens", "usage.completion_tokens"),
)


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="replay_command", required=True)
    record = commands.add_parser("record", help="send requests to a server, keep its responses")
    source = record.add_mutually_exclusive_group(required=True)
    source.add_argument("--requests", metavar="FILE", help="one OpenAI request body a line")
    source.add_argument(
        "--from-log", metavar="REQUEST_LOG", help="octavo's --request-log (see its answer)"
    )
    record.add_argument("--url", help="the server to record (with --requests)")
    record.add_argument("-o", "--output", required=True, metavar="GOLDEN.jsonl")
    check = commands.add_parser("check", help="send recorded requests again and compare")
    check.add_argument("golden", metavar="GOLDEN.jsonl")
    check.add_argument("--against", required=True, metavar="URL", help="the server to check")
    check.add_argument(
        "--model", default=None, help="the `model` every request names (the new server's)"
    )
    check.add_argument("--max-output-diffs", type=int, default=0, metavar="N")
    check.add_argument("--max-finish-reason-diffs", type=int, default=0, metavar="N")
    check.add_argument("--max-token-count-diffs", type=int, default=0, metavar="N")
    check.add_argument(
        "--max-latency-ratio",
        type=float,
        default=1.5,
        metavar="R",
        help="p50 and p99 latency may be at most R x the golden run's + --latency-slack",
    )
    check.add_argument("--latency-slack", type=float, default=0.05, metavar="SECONDS")
    check.add_argument("--show", type=int, default=10, metavar="N", help="differences listed")
    for sub in (record, check):
        sub.add_argument(
            "--api-key",
            default=os.environ.get("OPENAI_API_KEY"),
            help="the server's API key (default: $OPENAI_API_KEY)",
        )
        sub.add_argument("--concurrency", type=int, default=1, metavar="N")
        sub.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS")


# --- requests and responses ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a server answered to one request, reduced to what the gate compares."""

    status: int
    # Per choice, in index order: its tokens (None where the response has no logprobs), its
    # text and its finish reason.
    tokens: list[list[str] | None]
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "tokens": self.tokens,
            "texts": self.texts,
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_s": round(self.latency_s, 6),
            "error": self.error,
        }

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> Outcome:
        return cls(**item)


def read_requests(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) per line of a requests file. ValueError naming the line."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{number}: a request must be a JSON object")
            if "body" in item and "url" in item:  # a batch line
                endpoint, body = item["url"], item["body"]
            elif "messages" in item:
                endpoint, body = CHAT, item
            elif "prompt" in item:
                endpoint, body = COMPLETIONS, item
            else:
                raise ValueError(f"{path}:{number}: a body needs `messages` or `prompt`")
            if endpoint not in (CHAT, COMPLETIONS):
                raise ValueError(f"{path}:{number}: url must be {CHAT} or {COMPLETIONS}")
            requests.append((endpoint, greedy_with_logprobs(endpoint, body)))
    return requests


def greedy_with_logprobs(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body as recorded: temperature 0 unless it sets one, logprobs asked for unless it
    asks itself, never a stream."""
    body = {**body, "stream": False}
    body.setdefault("temperature", 0)
    if endpoint == CHAT:
        body.setdefault("logprobs", True)
    else:
        body.setdefault("logprobs", 1)
    return body


def send(client: httpx.Client, endpoint: str, body: dict[str, Any]) -> Outcome:
    started = time.monotonic()
    try:
        response = client.post(endpoint, json=body)
    except httpx.HTTPError as exc:
        return Outcome(0, [], [], [], None, None, time.monotonic() - started, repr(exc))
    latency_s = time.monotonic() - started
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    if response.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else response.text[:200]
        return Outcome(response.status_code, [], [], [], None, None, latency_s, message)
    choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
    usage = answer.get("usage") or {}
    return Outcome(
        200,
        [_tokens(endpoint, c) for c in choices],
        [_text(endpoint, c) for c in choices],
        [c.get("finish_reason") for c in choices],
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
        latency_s,
    )


def _text(endpoint: str, choice: dict[str, Any]) -> str:
    if endpoint == CHAT:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _tokens(endpoint: str, choice: dict[str, Any]) -> list[str] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if endpoint == CHAT:
        content = logprobs.get("content")
        return None if content is None else [item["token"] for item in content]
    tokens = logprobs.get("tokens")
    return None if tokens is None else list(tokens)


def send_all(
    url: str,
    requests: list[tuple[str, dict[str, Any]]],
    api_key: str | None,
    concurrency: int,
    timeout_s: float,
) -> list[Outcome]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with (
        httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as client,
        ThreadPoolExecutor(max(concurrency, 1)) as pool,
    ):
        return list(pool.map(lambda r: send(client, *r), requests))


# --- record ---------------------------------------------------------------------------------------


def run_record(ns: argparse.Namespace) -> int:
    if ns.from_log is not None:
        raise ValueError(
            f"--from-log {ns.from_log}: octavo's request log keeps each request's lengths, "
            "finish reason and times, never its prompt or output text, so there is nothing "
            "in it to replay. Record with --requests FILE (one OpenAI request body a line) "
            "--url URL instead."
        )
    if not ns.url:
        raise ValueError("--requests needs --url (the server to record).")
    requests = read_requests(ns.requests)
    outcomes = send_all(ns.url, requests, ns.api_key, ns.concurrency, ns.timeout)
    with open(ns.output, "w", encoding="utf-8") as f:
        for index, ((endpoint, body), outcome) in enumerate(zip(requests, outcomes, strict=True)):
            line = {"id": index, "endpoint": endpoint, "body": body, **outcome.to_json()}
            f.write(json.dumps(line) + "\n")
    failed = sum(1 for o in outcomes if o.status != 200)
    print(f"recorded {len(outcomes)} requests from {ns.url} to {ns.output} ({failed} failed)")
    return 0


# --- check ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    request_id: int
    check: str
    golden: Any
    new: Any


def compare(request_id: int, golden: Outcome, new: Outcome) -> list[Difference]:
    """The checks (CHECKS) on which `new` differs from `golden`."""
    found = []

    def differ(check: str, a: Any, b: Any) -> None:
        if a != b:
            found.append(Difference(request_id, check, a, b))

    differ("status", golden.status, new.status)
    if golden.status != 200 or new.status != 200:
        return found
    both_tokens = all(t is not None for t in golden.tokens + new.tokens)
    if both_tokens and len(golden.tokens) == len(new.tokens):
        differ("output", golden.tokens, new.tokens)
    else:
        differ("output", golden.texts, new.texts)
    differ("finish_reason", golden.finish_reasons, new.finish_reasons)
    differ("prompt_tokens", golden.prompt_tokens, new.prompt_tokens)
    differ("completion_tokens", golden.completion_tokens, new.completion_tokens)
    return found


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def run_check(ns: argparse.Namespace) -> int:
    recorded = []
    with open(ns.golden, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{ns.golden}:{number}: not valid JSON ({exc})") from None
            recorded.append(item)
    if not recorded:
        raise ValueError(f"{ns.golden}: no recorded request")
    requests = []
    for item in recorded:
        body = dict(item["body"])
        if ns.model is not None:
            body["model"] = ns.model
        requests.append((item["endpoint"], body))
    goldens = [
        Outcome.from_json({k: item[k] for k in Outcome.__dataclass_fields__}) for item in recorded
    ]
    outcomes = send_all(ns.against, requests, ns.api_key, ns.concurrency, ns.timeout)
    differences = [
        d
        for item, golden, new in zip(recorded, goldens, outcomes, strict=True)
        for d in compare(item["id"], golden, new)
    ]
    report, failed = check_report(goldens, outcomes, differences, ns)
    print(report)
    return 1 if failed else 0


def check_report(
    goldens: list[Outcome],
    outcomes: list[Outcome],
    differences: list[Difference],
    ns: argparse.Namespace,
) -> tuple[str, bool]:
    """The table (and the first differences), and whether a threshold is passed."""
    limits = {
        "status": 0,
        "output": ns.max_output_diffs,
        "finish_reason": ns.max_finish_reason_diffs,
        "prompt_tokens": ns.max_token_count_diffs,
        "completion_tokens": ns.max_token_count_diffs,
    }
    rows = [("check", "golden", "new", "differ", "allowed", "verdict")]
    failed = False
    for check, _ in CHECKS:
        count = len({d.request_id for d in differences if d.check == check})
        bad = count > limits[check]
        failed |= bad
        rows.append((check, "", "", str(count), str(limits[check]), "FAIL" if bad else "ok"))
    for q in (50, 99):
        old_s = percentile([o.latency_s for o in goldens], q)
        new_s = percentile([o.latency_s for o in outcomes], q)
        allowed_s = old_s * ns.max_latency_ratio + ns.latency_slack
        bad = new_s > allowed_s
        failed |= bad
        ratio = f"{new_s / old_s:.2f}x" if old_s > 0 else "-"
        rows.append(
            (
                f"latency p{q} (s)",
                f"{old_s:.3f}",
                f"{new_s:.3f}",
                ratio,
                f"<= {allowed_s:.3f}",
                "FAIL" if bad else "ok",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{len(outcomes)} requests"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for difference in differences[: ns.show]:
        if difference.check == "output":
            shown = divergence(difference.golden, difference.new)
        else:
            shown = f"{_short(difference.golden)} -> {_short(difference.new)}"
        lines.append(f"request {difference.request_id}: {difference.check} {shown}")
    if len(differences) > ns.show:
        lines.append(f"... {len(differences) - ns.show} more differences")
    lines.append("FAIL" if failed else "PASS")
    return "\n".join(lines), failed


def divergence(golden: list[Any], new: list[Any]) -> str:
    """Where two outputs (per choice: a token list or a text) first part: the choice, the
    position (token index, or character for texts) and what each side has from there."""
    for index, (a, b) in enumerate(zip(golden, new)):
        if a == b:
            continue
        unit = "char" if isinstance(a, str) else "token"
        a = a or ([] if unit == "token" else "")
        b = b or ([] if unit == "token" else "")
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return (
            f"choice {index} from {unit} {at} (of {len(a)} -> {len(b)}): "
            f"{_short(a[at : at + 6], 40)} -> {_short(b[at : at + 6], 40)}"
        )
    return f"{len(golden)} choices -> {len(new)}"


def _short(value: Any, width: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def run_replay(ns: argparse.Namespace) -> int:
    """ValueError (the CLI prints it, exit 2) for input it cannot use."""
    try:
        if ns.replay_command == "record":
            return run_record(ns)
        return run_check(ns)
    except OSError as exc:
        raise ValueError(f"{exc.filename}: {exc.strerror}") from None
