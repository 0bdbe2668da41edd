"""`octavo bench serve`: a streaming load generator for any OpenAI-compatible server.

Sends `--num-prompts` completions (`/v1/completions`, streaming, usage requested) with at most
`--max-concurrency` in flight, and reports vLLM's serving metrics: requests/s, output and total
tok/s, and mean/median/p99 of TTFT, TPOT, ITL, E2EL, plus each request's largest gap between two
chunks after its first token (the stall a user sees). Prints the configuration first and ends
with one JSON line.

Prompts are random token ids (exact input lengths; the server must accept token-id prompts, as
vLLM and octavo do), random words (`--prompt-format text`, for servers that take text only), or
input-grounded tasks (`--prompt-format grounded`): a passage of `--input-len` words and an
instruction to repeat it or to edit it lightly, so that answers copy long spans of the prompt,
the workload speculative decoding's n-gram and suffix proposals are for (compare TPOT with and
without `--speculative-config` on the server).
Must not: import the engine; it measures a server over HTTP and nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot"
).split()


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--model", default=None, help="`model` field (default: the first of /v1/models)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--prompt-format", choices=["tokens", "text", "grounded"], default="tokens")
    parser.add_argument(
        "--vocab-size", type=int, default=49152, help="random token ids are drawn below this"
    )
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    # Gaps between consecutive chunks that carried text, after the first one.
    itls_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def max_gap_s(self) -> float:
        return max(self.itls_s, default=0.0)

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)


# --prompt-format grounded: what each prompt asks of its passage (answers copy the passage).
GROUNDED_TASKS = (
    "Repeat the passage above exactly, word for word.",
    "Rewrite the passage above with every sentence in the same order, replacing the word "
    "'time' with 'moment' and changing nothing else.",
    "Copy the passage above, then add one sentence at its end.",
)


def grounded_prompt(rng: random.Random, num_words: int) -> str:
    """A passage of about num_words words in short sentences, then a task from GROUNDED_TASKS."""
    sentences, count = [], 0
    while count < num_words:
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(6, 12))]
        sentences.append(" ".join(words).capitalize() + ".")
        count += len(words)
    passage = " ".join(sentences)
    return f"Passage:\n{passage}\n\n{rng.choice(GROUNDED_TASKS)}\n\nAnswer:\n"


def make_prompts(ns: argparse.Namespace) -> list[list[int] | str]:
    rng = random.Random(ns.dataset_seed)
    if ns.prompt_format == "grounded":
        return [grounded_prompt(rng, ns.input_len) for _ in range(ns.num_prompts)]
    if ns.prompt_format == "text":
        return [
            " ".join(rng.choice(_WORDS) for _ in range(ns.input_len)) for _ in range(ns.num_prompts)
        ]
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(1000, ns.vocab_size // 2)
    return [
        [rng.randrange(low, ns.vocab_size) for _ in range(ns.input_len)]
        for _ in range(ns.num_prompts)
    ]


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]
) -> RequestResult:
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                if data.get("usage"):
                    result.num_prompt_tokens = data["usage"]["prompt_tokens"]
                    result.num_output_tokens = data["usage"]["completion_tokens"]
                choices = data.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
        result.e2el_s = time.perf_counter() - start
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


async def run_load(ns: argparse.Namespace, model: str) -> tuple[list[RequestResult], float]:
    url = ns.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    semaphore = asyncio.Semaphore(ns.max_concurrency)
    limits = httpx.Limits(max_connections=ns.max_concurrency + 4)

    async with httpx.AsyncClient(timeout=ns.timeout_s, limits=limits) as client:

        async def limited(prompt: list[int] | str) -> RequestResult:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": ns.output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if ns.ignore_eos:
                body["ignore_eos"] = True
            async with semaphore:
                return await send_one(client, url, body, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in make_prompts(ns)))
        return list(results), time.perf_counter() - start


def _first_model(ns: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    response = httpx.get(ns.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def summarize(results: list[RequestResult], elapsed_s: float) -> dict[str, float | int]:
    done = [r for r in results if r.ok]
    num_output = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens for r in done)
    summary: dict[str, float | int] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(elapsed_s, 3),
        "total_input_tokens": num_prompt,
        "total_output_tokens": num_output,
        "request_throughput": round(len(done) / elapsed_s, 3),
        "output_throughput": round(num_output / elapsed_s, 2),
        "total_token_throughput": round((num_output + num_prompt) / elapsed_s, 2),
    }
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2el_s for r in done],
        "max_gap": [r.max_gap_s for r in done],
    }
    for name, values in series.items():
        summary[f"mean_{name}_ms"] = round(1000 * statistics.fmean(values), 2) if values else 0.0
        summary[f"median_{name}_ms"] = round(1000 * statistics.median(values), 2) if values else 0.0
        summary[f"p99_{name}_ms"] = round(1000 * _percentile(values, 99), 2) if values else 0.0
    return summary


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_serve_bench(ns: argparse.Namespace) -> int:
    # One log line per HTTP request would drown the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = ns.model or _first_model(ns)
    config = {k: v for k, v in vars(ns).items() if k not in ("api_key", "command", "bench_command")}
    config["model"] = model
    print("config:", json.dumps(config, sort_keys=True))
    results, elapsed = asyncio.run(run_load(ns, model))
    summary = summarize(results, elapsed)
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    print(
        f"Successful requests: {summary['completed']} / {len(results)} in {summary['duration_s']} s"
    )
    print(
        f"Request throughput: {summary['request_throughput']} req/s; output "
        f"{summary['output_throughput']} tok/s; total {summary['total_token_throughput']} tok/s"
    )
    for name, label in (
        ("ttft", "TTFT"),
        ("tpot", "TPOT"),
        ("itl", "ITL"),
        ("e2el", "E2EL"),
        ("max_gap", "Max gap"),
    ):
        print(
            f"{label:>8} ms: mean {summary[f'mean_{name}_ms']:>9}  median "
            f"{summary[f'median_{name}_ms']:>9}  p99 {summary[f'p99_{name}_ms']:>9}"
        )
    print(json.dumps(summary))
    return 0 if not errors else 1
